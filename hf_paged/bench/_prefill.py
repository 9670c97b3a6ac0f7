"""Prefill benchmark rows (``hf-paged bench kernels --only prefill`` calls :func:`run`).

Causal varlen prefill, bf16, 32 query / 8 kv heads, head_dim 128 and 64, at the anchor shapes of
``shared/gpu/anchors.md`` (16 x 512, 8 x 2048, 2 x 8192 tokens), timed in one run for: hf_paged's paged prefill
reading K/V through block tables of block size 16 and 256 (each tile configuration at block size 16, to choose
the default), flash-attn's ``flash_attn_varlen_func`` and torch's built-in varlen FA2
(``aten._flash_attention_forward``), both on contiguous K/V. Then the same work with a cached prefix (8 sequences
of 2048 new tokens after 2048 cached ones): hf_paged at block size 16 against hf_paged on an unpaged layout (one
block per sequence), and flash-attn with ``cu_seqlens_k``. ``ours-fp8-bs16`` is the block-size-16 prefill over the
same context quantized to an e4m3 cache (per-head scales, ``kv_cache_dtype="fp8"``), checked against bf16 with a
looser bound (the quantization's error, not the kernel's). On compute capability 9.0, ``ours-wgmma-bs16`` and
``ours-wgmma-serial-bs16`` are the same block-size-16 prefill through the Hopper kernels (``impl="wgmma"``,
``"wgmma-serial"``, at the head sizes they serve; the cuda backend's default there), and ``ours-wgmma-unpaged`` the
pipelined one on the unpaged layout (what paging costs it).

FLOPs = sum over sequences of 4 * H * D * (n * p + n * n / 2) for n new tokens after p cached ones (two matrix
products of 2 * H * D flops per visible (query, key) pair; causal halves the new-by-new square, as anchors.md does).

Sliding-window and softcap rows (``windows``/``softcaps``; head_dim 128): the pairs of ``kernels.score_options`` at
``OPTION_SHAPES``, hf_paged at block size 16 and 256 against flash-attn's varlen kernel with the same
``window_size``/``softcap``; a windowed row counts the (query, key) pairs its window leaves visible, exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_paged import _compat
from hf_paged.attention.backends._flash import load_flash_attn, window_size
from hf_paged.bench import input_sets, time_calls
from hf_paged.bench._kernels import add_fp8_cache, cache_args, check_outputs, paged_kv, report, score_options
from hf_paged.kernels import FP8_HEAD_DIMS
from hf_paged.kernels._prefill import PREFILL_CONFIGS, WGMMA_HEAD_DIMS, paged_prefill

NUM_HEADS, NUM_KV_HEADS, DTYPE = 32, 8, torch.bfloat16
SHAPES = ((16, 512), (8, 2048), (2, 8192))  # sequences x new tokens, no prefix
PREFIX_SHAPE = (8, 2048, 2048)  # sequences, cached prefix, new tokens
OPTION_SHAPES = ((8, 0, 2048), (2, 0, 8192), PREFIX_SHAPE)  # sequences, cached prefix, new tokens


@dataclass
class Row:
    head_dim: int
    shape: str
    impl: str
    us: float
    tflops: float
    method: str
    note: str = ""
    window: int = 0
    softcap: float = 0.0


def visible_pairs(prefix: int, new: int, window: int = 0) -> float:
    """(query, key) pairs one sequence's new tokens see: n * p + n * n / 2 without a window (anchors.md's count),
    else the sum over positions i of min(i + 1, window), exactly."""
    if not window:
        return new * prefix + new * new / 2
    lo, hi = prefix + 1, prefix + new  # each new token sees i + 1 keys, before the window
    if window >= hi:
        return (lo + hi) * (hi - lo + 1) / 2
    if window < lo:
        return window * new
    return (lo + window) * (window - lo + 1) / 2 + window * (hi - window)


def make_set(batch: int, prefix: int, new: int, head_dim: int, gen: torch.Generator) -> dict:
    ctx = prefix + new
    k, v = (torch.randn(batch * ctx, NUM_KV_HEADS, head_dim, device="cuda", generator=gen, dtype=DTYPE) for _ in "kv")
    s = {"q": torch.randn(batch * new, NUM_HEADS, head_dim, device="cuda", generator=gen, dtype=DTYPE), "k": k,
         "v": v, "cu_q": torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * new,
         "cu_k": torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * ctx,
         "seq_lens": torch.full((batch,), ctx, device="cuda", dtype=torch.int32)}
    for bs in (16, 256, ctx):  # block size ctx: one block per sequence, i.e. the unpaged layout
        g = torch.Generator(device="cuda").manual_seed(bs)
        s[f"k{bs}"], s[f"v{bs}"], s[f"t{bs}"] = paged_kv(k, v, batch, bs, g)
    return add_fp8_cache(s)


def contenders(sets: list[dict], prefix: int, new: int, head_dim: int, sweep: bool, window: int = 0,
               softcap: float = 0.0) -> dict[str, list]:
    """name -> one zero-argument callable per input set."""
    scale, ctx = head_dim**-0.5, prefix + new

    def ours(block_size: int, fp8: bool = False, **options) -> list:
        return [functools.partial(paged_prefill, s["q"], cu_seqlens_q=s["cu_q"], seq_lens_k=s["seq_lens"], scale=scale,
                                  max_seqlen_q=new, window=window, softcap=softcap, **options,
                                  **cache_args(s, block_size, fp8)) for s in sets]

    out = {"ours-bs16": ours(16), "ours-bs256": ours(256), "ours-unpaged": ours(ctx)}
    if torch.cuda.get_device_capability() == (9, 0) and head_dim in WGMMA_HEAD_DIMS:
        out["ours-wgmma-bs16"] = ours(16, impl="wgmma")
        out["ours-wgmma-serial-bs16"] = ours(16, impl="wgmma-serial")
        out["ours-wgmma-unpaged"] = ours(ctx, impl="wgmma")
    if head_dim in FP8_HEAD_DIMS:  # the e4m3 kernels' sizes
        out["ours-fp8-bs16"] = ours(16, fp8=True)
    if sweep:
        out.update({f"ours-bs16-c{c}": ours(16, config=c) for c in PREFILL_CONFIGS})
    if (fa := load_flash_attn()) is not None:
        out["flash-varlen"] = [lambda s=s: fa.flash_attn_varlen_func(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], new,
                                                                     ctx, softmax_scale=scale, causal=True,
                                                                     window_size=window_size(window or None),
                                                                     softcap=softcap)
                               for s in sets]
    # torch's built-in kernel aligns causal masks top-left (only comparable without a prefix) and takes no softcap
    if prefix == 0 and not window and not softcap:
        fa2 = _compat.flash_attention_forward()
        out["torch-fa2"] = [lambda s=s: fa2(
            s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], new, ctx, 0.0, True, False, scale=scale)[0] for s in sets]
    return out


def bench_shape(batch: int, prefix: int, new: int, head_dim: int, gen: torch.Generator, sweep: bool, window: int = 0,
                softcap: float = 0.0) -> list[Row]:
    nbytes = batch * (new * NUM_HEADS + 2 * (prefix + new) * NUM_KV_HEADS) * head_dim * DTYPE.itemsize
    sets = [make_set(batch, prefix, new, head_dim, gen) for _ in range(min(3, input_sets(nbytes)))]
    work = batch * 4.0 * NUM_HEADS * head_dim * visible_pairs(prefix, new, window)  # see the module docstring
    label = f"{batch}x{new}" + (f"+{prefix}" if prefix else "")
    label += (f" w{window}" if window else "") + (f" cap{softcap:g}" if softcap else "")
    rows, outputs = [], {}
    for name, calls in contenders(sets, prefix, new, head_dim, sweep, window, softcap).items():
        try:
            outputs[name] = calls[0]().float()
            t = time_calls(calls, budget_s=0.4)
        except RuntimeError as exc:  # a baseline that cannot run here is reported, not fatal
            print(f"hd{head_dim} {label}: {name} failed: {exc}", flush=True)
            continue
        rows.append(Row(head_dim, label, name, t.median_s * 1e6, work / t.median_s / 1e12, t.method, "", window,
                        softcap))
        print(_format(rows[-1]), flush=True)
    check_outputs(rows, outputs)
    return rows


def _format(r: Row) -> str:
    return f"hd{r.head_dim} {r.shape:<12} {r.impl:<16} {r.us:10.1f} us {r.tflops:7.1f} TFLOP/s [{r.method}] {r.note}"


def run(json_path: str | Path | None = None, head_dims: tuple[int, ...] = (128, 64), sweep: bool = True,
        windows: tuple[int, ...] = (), softcaps: tuple[float, ...] = ()) -> dict:
    """Time every row; print the table last; write JSON to ``json_path`` if given. ``windows`` / ``softcaps`` add
    the sliding-window and softcap rows (see the module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [r for hd in head_dims for b, n in SHAPES for r in bench_shape(b, 0, n, hd, gen, sweep and hd == 128)]
    rows += bench_shape(*PREFIX_SHAPE, 128, gen, sweep)
    rows += [r for window, softcap in score_options(windows, softcaps) for b, p, n in OPTION_SHAPES
             for r in bench_shape(b, p, n, 128, gen, False, window, softcap)]
    return report(rows, json_path, print_table, device=torch.cuda.get_device_name())


def print_table(result: dict) -> None:
    """TFLOP/s per shape and implementation, and ours (block size 16) over flash-attn."""
    impls = ["ours-bs16", "ours-fp8-bs16", "ours-wgmma-bs16", "ours-wgmma-serial-bs16", "ours-wgmma-unpaged",
             "ours-bs256", "ours-unpaged", "flash-varlen", "torch-fa2"]
    print(f"\n{result['device']}: causal prefill, bf16, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads; TFLOP/s")
    width = max([12] + [len(r["shape"]) for r in result["rows"]])
    widths = [max(12, len(i)) for i in impls]
    print(f"{'hd':>4} {'shape':<{width}} | " + " | ".join(i.rjust(w) for i, w in zip(impls, widths))
          + " | bs16/flash | wgmma/flash | best config")
    cells: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        cells.setdefault((r["head_dim"], r["shape"]), {})[r["impl"]] = r
    for (hd, shape), got in cells.items():
        text = [(f"{got[i]['tflops']:.1f}" if i in got else "-").rjust(w) for i, w in zip(impls, widths)]
        ratio, wgmma_ratio = (_ratio(got, impl, "flash-varlen") for impl in ("ours-bs16", "ours-wgmma-bs16"))
        sweep = {k: v["tflops"] for k, v in got.items() if k.startswith("ours-bs16-c")}
        best = max(sweep, key=sweep.get, default=None)
        best_text = f"{best[-2:]} {sweep[best]:.1f}" if best else "-"
        print(f"{hd:>4} {shape:<{width}} | " + " | ".join(text) + f" | {ratio:>10} | {wgmma_ratio:>11} | {best_text}")


def _ratio(got: dict[str, dict], impl: str, baseline: str) -> str:
    return f"{got[impl]['tflops'] / got[baseline]['tflops']:.2f}" if impl in got and baseline in got else "-"

