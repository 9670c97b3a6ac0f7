"""What the kernel tests share: random paged decode and prefill steps on the GPU (new tokens already in a shuffled
cache, ``POISON`` in the slots no sequence owns), the float64 torch oracle, and the check every output passes, over
the whole batch and row by row (tests/helpers/kernel_oracle.py); the (window, softcap) options of the
sliding-window tests. Importable without a GPU (nothing here touches the device until called)."""

from __future__ import annotations

import torch
from kernel_oracle import assert_rows_close, random_allowance
from paged_steps import make_paged_step

from hf_paged import available_backends, kernels
from hf_paged.attention import AttentionCall, AttentionParams, Phase
from hf_paged.attention.backends._torch import paged_attention_reference
from hf_paged.attention.backends.base import registered_backends

DEVICE = torch.device("cuda")
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# Per (row, head): largest element error over the row's rms (rounding alone reaches ~3 * 2^-9 in bf16).
ROW_TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 8e-3, torch.float32: 1e-4}

# cached prefix lengths, new-token counts (length-1 rows, ragged tails, prefixes ending mid-block)
PREFILL_SCENARIOS = {
    "one-token": ([0], [1]),
    "ragged-prefill": ([0, 0, 0, 0, 0, 0], [1, 17, 64, 65, 129, 300]),
    "extend-mixed": ([0, 5, 1000, 47, 3995], [1, 1, 33, 200, 5]),
    "long-prefix": ([3000, 0], [700, 1]),
}

# (sliding window, softcap); 0 = off
OPTIONS = [(5, 0.0), (100, 0.0), (1000, 0.0), (100_000, 0.0), (0, 5.0), (100, 5.0), (1000, 50.0)]
QUERY_GAIN = 3.0  # random scores have an rms of ~1 at scale D^-0.5; ~3 makes a softcap of 5 matter


def decode_step(ctx_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, gen):
    """A decode step on the GPU: (meta, query, key, value, k_cache, v_cache, params)."""
    meta, key, value = make_paged_step([n - 1 for n in ctx_lens], [1] * len(ctx_lens), block_size, num_kv_heads,
                                       head_dim, dtype, gen)
    assert meta.phase is Phase.DECODE or min(ctx_lens) == max(ctx_lens) == 1
    k_cache, v_cache = (t.to(DEVICE) for t in meta.kv_caches[0])
    query = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    params = AttentionParams(scale=head_dim**-0.5)
    return meta.on(DEVICE), query, key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, params


def reference(query, k_cache, v_cache, meta, params) -> torch.Tensor:
    return paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                     compute_dtype=torch.float64)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def run_decode(query, k_cache, v_cache, meta, params, split_len: int = 0, out: torch.Tensor | None = None,
               **options) -> torch.Tensor:
    """kernels.paged_decode over a decode_step's tensors (``options``: window, softcap, workspace, scales...)."""
    out = torch.full_like(query, float("nan")) if out is None else out  # every element must be written
    return kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, params.scale,
                                max_seq_len=meta.max_seqlen_k, out=out, split_len=split_len, **options)


def runnable_backends(call: AttentionCall):
    """Backends under test: every registered one that serves ``call`` except torch, the oracle."""
    available_backends()  # imports (so registers) every backend module
    return [b for b in registered_backends() if b.name != "torch" and b.unsupported_reason(call) is None]


def check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, label: str) -> None:
    assert not out.isnan().any(), f"{label}: NaN left in the output (unwritten rows or overflow)"
    rel = relative_error(out, expected)
    assert rel < TOLERANCE[dtype], f"{label}: relative error {rel:.2e}"
    assert_rows_close(out, expected, random_allowance(expected, ROW_TOLERANCE[dtype]), label)


def prefill_step(prefix_lens, new_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, gen):
    """(meta, query, key, value, k_cache, v_cache, params) on the GPU, new tokens already in the cache."""
    meta, key, value = make_paged_step(prefix_lens, new_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    k_cache, v_cache = (t.to(DEVICE) for t in meta.kv_caches[0])
    query = torch.randn(sum(new_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    params = AttentionParams(scale=head_dim**-0.5)
    return meta.on(DEVICE), query, key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, params


def params_for(head_dim: int, window: int, softcap: float) -> AttentionParams:
    return AttentionParams(scale=head_dim**-0.5, sliding_window=window or None, softcap=softcap or None)


def other_backends(call: AttentionCall) -> list:
    """The backends to check beside our kernel: the cuda backend always; the others (flash-attn) without a softcap
    only, since flash-attn's approximate tanh (relative error ~2^-11) exceeds the fp16 tolerance on scores of ~10."""
    return [b for b in runnable_backends(call) if b.name == "cuda" or call.softcap is None]
