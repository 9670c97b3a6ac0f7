"""Kernel benchmark (``hf-paged bench kernels``): paged decode and KV write against the copy-bandwidth ceiling.

One run measures the device-to-device copy bandwidth, then for each shape (the anchors of
``shared/gpu/anchors.md``: bf16, 32 query / 8 kv heads, head_dim 128 and 64) times hf_paged's decode at block
size 16 and 256, flash-attn's ``flash_attn_with_kvcache`` at block size 256 (when the flash backend loads it) and
the torch backend, then the KV write of 4096 tokens. Bandwidth = KV bytes read / median time. Prints a table last and
writes everything as JSON. From compute capability 9.0 on, decode is launched with programmatic dependent launch
(each launch may start while the one before finishes, so back-to-back launches overlap); ``ours-nopdl-bs16`` is the
block-size-16 decode without it (``paged_decode(..., pdl=False)``: each launch alone, as flash-attn's).
``ours-fp8-bs16`` is the decode over the same context quantized to an e4m3 cache (per-head
scales, ``kv_cache_dtype="fp8"``): its bytes are half, and it is checked against bf16 with a looser bound (the
quantization's error, not the kernel's). With ``sweep`` (``--no-sweep`` skips it), the head_dim 128 shapes of
``SPLIT_SWEEP_SHAPES`` also time the block-size-16 decode at each fixed split length of ``SPLIT_LENS``
(``ours-bs16-split<n>``): the data behind the split heuristic.

Sliding-window and softcap rows (``windows``/``softcaps``, head_dim = the first asked for): every (window, softcap)
pair of the options, each alone too, at ``OPTION_SHAPES``, flash-attn with the same ``window_size``/``softcap``. A
windowed decode reads only the last ``window`` keys, so its bandwidth counts ``min(ctx, window)`` tokens.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_paged import kernels
from hf_paged.cache import _kv_quant as kv_quant
from hf_paged.attention.backends.base import AttentionInputs, AttentionParams
from hf_paged.attention.backends._flash import load_flash_attn, window_size
from hf_paged.attention.backends._torch import TorchBackend
from hf_paged.attention._metadata import build_metadata
from hf_paged.bench import copy_bandwidth, input_sets, run_header, time_calls

ANCHOR_SHAPES = ((1, 8192), (8, 4096), (64, 512), (64, 2048), (64, 8192), (256, 1024))
OPTION_SHAPES = ((1, 8192), (8, 4096), (64, 2048), (64, 8192))
NUM_HEADS, NUM_KV_HEADS, DTYPE = 32, 8, torch.bfloat16
WRITE_TOKENS = 4096
SPLIT_LENS = (64, 128, 256, 512, 1024, 2048)  # the split-length sweep's, at SPLIT_SWEEP_SHAPES
SPLIT_SWEEP_SHAPES = ((128, 1, 8192), (128, 8, 4096))  # head_dim, batch, ctx


@dataclass
class Row:
    head_dim: int
    batch: int
    ctx: int
    impl: str
    us: float
    tbps: float
    pct_copy: float
    method: str
    note: str = ""
    window: int = 0
    softcap: float = 0.0


def score_options(windows: tuple[int, ...], softcaps: tuple[float, ...]) -> list[tuple[int, float]]:
    """The (window, softcap) rows to time: each window and each softcap alone, and every pair (0 = off)."""
    return [(w, c) for w in (0, *windows) for c in (0.0, *softcaps) if w or c]


def paged_kv(k: torch.Tensor, v: torch.Tensor, batch: int, block_size: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V of ``batch`` sequences of one length L (a multiple of ``block_size``), ``[B, L, Hkv, D]`` or
    ``[B * L, Hkv, D]``, stored in the same shuffled blocks: (k_cache, v_cache, block_tables ``[B, L / block_size]``
    int32)."""
    blocks = k.reshape(-1, block_size, *k.shape[-2:])
    perm = torch.randperm(blocks.shape[0], device=k.device, generator=gen)
    k_cache, v_cache = torch.empty_like(blocks), torch.empty_like(blocks)
    k_cache[perm] = blocks  # logical block i lives at physical block perm[i]
    v_cache[perm] = v.reshape_as(blocks)
    return k_cache, v_cache, perm.view(batch, -1).to(torch.int32)


def add_fp8_cache(s: dict) -> dict:
    """``s`` with its block-size-16 cache (``k16``, ``v16``) also as e4m3 with per-head scales, as
    ``kv_cache_dtype="fp8"`` stores it: ``k16_fp8``, ``v16_fp8``, ``k_scale``, ``v_scale``."""
    for name in ("k", "v"):
        cache = s[f"{name}16"]
        scale = torch.zeros(cache.shape[-2], dtype=torch.float32, device=cache.device)
        kv_quant.fix_unset_scales(scale, cache.flatten(0, 1))
        s[f"{name}16_fp8"], s[f"{name}_scale"] = kv_quant.quantize(cache.flatten(0, 1), scale).view(cache.shape), scale
    return s


def cache_args(s: dict, block_size: int, fp8: bool = False) -> dict:
    """The cache arguments (``k_cache``, ``v_cache``, ``block_tables``) of an hf_paged op over the input set ``s`` at
    ``block_size``; with ``fp8`` over its e4m3 copy (:func:`add_fp8_cache`), with ``k_scale`` and ``v_scale``."""
    cache = f"{block_size}_fp8" if fp8 else f"{block_size}"
    scales = {"k_scale": s["k_scale"], "v_scale": s["v_scale"]} if fp8 else {}
    return {"k_cache": s[f"k{cache}"], "v_cache": s[f"v{cache}"], "block_tables": s[f"t{block_size}"], **scales}


def check_outputs(rows: list, outputs: dict[str, torch.Tensor]) -> None:
    """Add each row's relative difference from ``ours-bs16`` to its note, and raise where it exceeds the bound:
    every contender computed the same attention, and a wrong kernel must not post a fast time."""
    ref = outputs["ours-bs16"]
    for row in rows:
        err = ((outputs[row.impl] - ref).norm() / ref.norm()).item()
        row.note = f"{row.note} diff={err:.1e}".strip()
        if err > (0.15 if "fp8" in row.impl else 2e-2):  # fp8: e4m3's rounding of K and V, ~2^-4 per element
            raise RuntimeError(f"{row.impl} disagrees with ours-bs16 at {row}: relative difference {err:.2e}")


def report(rows: list, json_path: str | Path | None, print_table: Callable[[dict], None], **fields) -> dict:
    """A benchmark's result: the run header, ``fields`` and the rows, written as JSON to ``json_path`` (if given),
    then printed by ``print_table``."""
    result = {**run_header(), **fields, "rows": [asdict(r) for r in rows]}
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


def decode_set(batch: int, ctx: int, head_dim: int, gen: torch.Generator) -> dict:
    """One input set: query, and the same K/V context paged at block size 16 and 256."""
    shape = (batch, math.ceil(ctx / 256) * 256, NUM_KV_HEADS, head_dim)  # padded to whole blocks of 256
    k, v = (torch.randn(shape, device="cuda", generator=gen, dtype=DTYPE) for _ in "kv")
    s = {"query": torch.randn(batch, NUM_HEADS, head_dim, device="cuda", generator=gen, dtype=DTYPE),
         "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda")}
    for bs in (16, 256):
        s[f"k{bs}"], s[f"v{bs}"], s[f"t{bs}"] = paged_kv(k, v, batch, bs, gen)
    return add_fp8_cache(s)


def contenders(sets: list[dict], ctx: int, head_dim: int, window: int = 0, softcap: float = 0.0,
               splits: tuple[int, ...] = ()) -> dict[str, list]:
    """name -> one zero-argument callable per input set; ``splits`` adds the block-size-16 decode at each of these
    fixed split lengths (the data behind the split heuristic)."""
    scale = head_dim**-0.5

    def ours(block_size: int = 16, fp8: bool = False, **options) -> list:
        return [functools.partial(kernels.paged_decode, s["query"], seq_lens=s["seq_lens"], scale=scale,
                                  max_seq_len=ctx, window=window, softcap=softcap, **options,
                                  **cache_args(s, block_size, fp8)) for s in sets]

    out = {"ours-bs16": ours(16), "ours-bs256": ours(256)}
    out.update({f"ours-bs16-split{split}": ours(split_len=split) for split in splits})
    if torch.cuda.get_device_capability()[0] >= 9:  # programmatic dependent launch: Hopper on
        out["ours-nopdl-bs16"] = ours(pdl=False)
    if head_dim in kernels.FP8_HEAD_DIMS:  # the e4m3 kernels' sizes
        out["ours-fp8-bs16"] = ours(fp8=True)
    if (fa := load_flash_attn()) is not None:
        out["flash-bs256"] = [
            lambda s=s: fa.flash_attn_with_kvcache(s["query"].unsqueeze(1), s["k256"], s["v256"],
                                                   cache_seqlens=s["seq_lens"], block_table=s["t256"],
                                                   softmax_scale=scale, causal=True,
                                                   window_size=window_size(window or None), softcap=softcap)
            for s in sets
        ]
    s0, batch = sets[0], len(sets[0]["seq_lens"])  # the torch backend: eager, over the first input set only
    meta = build_metadata(q_lens=torch.ones(batch, dtype=torch.int32), seq_lens_k=s0["seq_lens"].cpu(),
                          block_tables=s0["t16"].cpu(), slot_mapping=torch.zeros(batch, dtype=torch.long),
                          token_index=None, grid=(batch, 1), block_size=16, device=torch.device("cuda"))
    params = AttentionParams(scale=scale, sliding_window=window or None, softcap=softcap or None)
    inputs = AttentionInputs(s0["query"], None, None, s0["k16"], s0["v16"], meta, params)
    out["torch-bs16"] = [functools.partial(TorchBackend().forward, inputs, None)]
    return out


def bench_shape(head_dim: int, batch: int, ctx: int, copy_bps: float, gen: torch.Generator, window: int = 0,
                softcap: float = 0.0, split_sweep: bool = False) -> list[Row]:
    """Every contender at one shape; with ``split_sweep`` also the fixed split lengths of ``SPLIT_LENS`` that fit."""
    splits = tuple(s for s in SPLIT_LENS if s <= ctx and math.ceil(ctx / s) <= 256) if split_sweep else ()
    kv_bytes = batch * kernels.decode_keys(ctx, window) * 2 * NUM_KV_HEADS * head_dim * DTYPE.itemsize
    sets = [decode_set(batch, ctx, head_dim, gen) for _ in range(input_sets(kv_bytes))]
    rows, outputs = [], {}
    for name, calls in contenders(sets, ctx, head_dim, window, softcap, splits).items():
        outputs[name] = calls[0]().float().reshape(batch, NUM_HEADS, head_dim)
        timing = time_calls(calls, graph=not name.startswith("torch"), budget_s=0.3 if "torch" in name else 0.5)
        note = ""
        if name in ("ours-bs16", "ours-fp8-bs16"):
            k16 = sets[0]["k16_fp8" if "fp8" in name else "k16"]
            note = f"split_len={kernels.decode_split_len(sets[0]['query'], k16, ctx, window)}"
        nbytes = kv_bytes // 2 if "fp8" in name else kv_bytes  # e4m3: one byte an element
        rows.append(Row(head_dim, batch, ctx, name, timing.median_s * 1e6, nbytes / timing.median_s / 1e12,
                        100 * nbytes / timing.median_s / copy_bps, timing.method, note, window, softcap))
        print(_format(rows[-1]), flush=True)
    check_outputs(rows, outputs)
    return rows


def bench_write(head_dim: int, copy_bps: float, gen: torch.Generator) -> list[Row]:
    """KV write of WRITE_TOKENS tokens to random slots; bytes = K and V read once and written once."""
    nbytes = 2 * 2 * WRITE_TOKENS * NUM_KV_HEADS * head_dim * DTYPE.itemsize
    num_slots = 64 * WRITE_TOKENS
    cache_shape = (num_slots // 16, 16, NUM_KV_HEADS, head_dim)
    sets = [{"new": [torch.randn(WRITE_TOKENS, NUM_KV_HEADS, head_dim, device="cuda", generator=gen, dtype=DTYPE)
                     for _ in "kv"],
             "slots": torch.randperm(num_slots, device="cuda", generator=gen)[:WRITE_TOKENS],
             "cache": [torch.zeros(cache_shape, device="cuda", dtype=DTYPE) for _ in "kv"],
             "fp8": [torch.zeros(cache_shape, device="cuda", dtype=kv_quant.FP8_DTYPE) for _ in "kv"],
             "scales": kv_quant.KVScales.unset(NUM_KV_HEADS, torch.device("cuda"))}
            for _ in range(input_sets(nbytes))]
    impls = {
        "ours-write": [lambda s=s: kernels.write_kv(*s["new"], *s["cache"], s["slots"]) for s in sets],
        "ours-write-fp8": [lambda s=s: kernels.write_kv(*s["new"], *s["fp8"], s["slots"], k_scale=s["scales"].k,
                                                        v_scale=s["scales"].v) for s in sets],
        "torch-index_copy": [lambda s=s: [cache.view(-1, NUM_KV_HEADS, head_dim).index_copy_(0, s["slots"], new)
                                          for cache, new in zip(s["cache"], s["new"])] for s in sets],
    }
    rows = []
    for name, calls in impls.items():
        t = time_calls(calls)
        moved = nbytes * 3 // 4 if "fp8" in name else nbytes  # e4m3 stores one byte an element, reads two
        rows.append(Row(head_dim, WRITE_TOKENS, 0, name, t.median_s * 1e6, moved / t.median_s / 1e12,
                        100 * moved / t.median_s / copy_bps, t.method))
        print(_format(rows[-1]), flush=True)
    return rows


def _format(r: Row) -> str:
    shape = f"hd{r.head_dim} B={r.batch} ctx={r.ctx}" if r.ctx else f"hd{r.head_dim} T={r.batch}"
    shape += f" window={r.window}" if r.window else ""
    shape += f" softcap={r.softcap:g}" if r.softcap else ""
    return (f"{shape:<24} {r.impl:<22} {r.us:9.1f} us {r.tbps:6.2f} TB/s {r.pct_copy:5.1f}% of copy  "
            f"[{r.method}] {r.note}")


def run(json_path: str | Path | None = None, head_dims: tuple[int, ...] = (128, 64), sweep: bool = True,
        windows: tuple[int, ...] = (), softcaps: tuple[float, ...] = ()) -> dict:
    """Run the whole benchmark; print the table last; write JSON to ``json_path`` if given. ``windows`` /
    ``softcaps`` add the sliding-window and softcap rows (see the module docstring)."""
    if (reason := kernels.unavailable_reason()) is not None:
        raise RuntimeError(f"hf_paged kernels unavailable: {reason}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bps, copy_ways = copy_bandwidth()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    ways = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in copy_ways.items())
    print(f"{props.name}: copy bandwidth {copy_bps / 1e12:.2f} TB/s (best of: {ways} TB/s)")
    rows = [r for hd in head_dims for b, ctx in ANCHOR_SHAPES
            for r in bench_shape(hd, b, ctx, copy_bps, gen, split_sweep=sweep and (hd, b, ctx) in SPLIT_SWEEP_SHAPES)]
    rows += [r for window, softcap in score_options(windows, softcaps) for b, ctx in OPTION_SHAPES
             for r in bench_shape(head_dims[0], b, ctx, copy_bps, gen, window, softcap)]
    rows += [r for hd in head_dims for r in bench_write(hd, copy_bps, gen)]
    return report(rows, json_path, print_table, device=props.name, sms=props.multi_processor_count,
                  copy_tbps=copy_bps / 1e12, copy_ways_tbps={k: v / 1e12 for k, v in copy_ways.items()})


def print_table(result: dict) -> None:
    """Per shape: time / % of copy bandwidth for each implementation, and ours (bs 16) over flash (bs 256)."""
    impls = ["ours-bs16", "ours-nopdl-bs16", "ours-fp8-bs16", "ours-bs256", "flash-bs256", "torch-bs16"]
    print(f"\n{result['device']}, copy {result['copy_tbps']:.2f} TB/s; bf16, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads; "
          "each cell: us (% of copy)")
    print(f"{'hd':>4} {'B':>4} {'ctx':>5} {'window':>6} {'cap':>4} | " + " | ".join(f"{i:>17}" for i in impls)
          + " | flash/ours16")
    cells: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        if r["ctx"] and r["impl"] in impls:
            cells.setdefault((r["head_dim"], r["batch"], r["ctx"], r["window"], r["softcap"]), {})[r["impl"]] = r
    for (hd, b, ctx, window, softcap), got in cells.items():
        text = [f"{got[i]['us']:8.1f} ({got[i]['pct_copy']:4.1f}%)" if i in got else f"{'-':>17}" for i in impls]
        ratio = f"{got['flash-bs256']['us'] / got['ours-bs16']['us']:.2f}x" if "flash-bs256" in got else "-"
        print(f"{hd:>4} {b:>4} {ctx:>5} {window or '-':>6} {softcap or '-':>4} | " + " | ".join(text) + f" | {ratio}")
    for r in result["rows"]:
        if not r["ctx"]:
            print(f"KV write hd{r['head_dim']} T={r['batch']} {r['impl']:<18} {r['us']:7.1f} us "
                  f"{r['tbps']:5.2f} TB/s ({r['pct_copy']:.1f}% of copy)")
