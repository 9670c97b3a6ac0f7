"""What the exact-answer kernel tests (kernels/test_kernel_rows_*.py) share: the cases, and one check per kernel.

Keys are zero and values encode their position (tests/helpers/kernel_oracle.py), so every (row, head) of the output
is the exact mean of the visible keys' values: one key dropped or read twice at a block, split, tile or window edge
fails that row (tests/kernels/test_kernel_oracle.py proves the check catches it). Zero keys score 0 under any softcap,
so a softcap changes nothing in the answer and only exercises its code path. Each check builds its step once and runs
every split length or tile configuration asked for on it (the step and its float64 oracle are the slow part). The
torch backend in float64 is the oracle (and must itself equal the exact answer); it is not under test.
"""

from __future__ import annotations

import zlib

import torch
from kernel_oracle import assert_rows_close, exact_position_means, position_allowance, position_step

from hf_paged import kernels
from hf_paged.attention import AttentionParams
from hf_paged.attention.backends._torch import paged_attention_reference
from hf_paged.kernels._prefill import paged_prefill, prefill_configs

DEVICE = torch.device("cuda")
# Context lengths (new token included) on and around block, split and tile edges.
DECODE_LENS = [1, 2, 7, 8, 9, 15, 16, 17, 47, 48, 49, 63, 64, 65, 191, 192, 193, 255, 256, 257, 511, 512, 513, 1000,
               2049, 4097]
# (cached prefix lengths, new-token counts): query tiles of 64/128 rows and key tiles of 64, full and ragged.
PREFILL_SCENARIOS = {
    "tile-edges": ([0, 0, 0, 0, 0, 0], [1, 63, 64, 65, 127, 129]),
    "prefix-edges": ([15, 16, 17, 63, 64, 65, 1000], [1, 64, 65, 127, 128, 129, 300]),
    "long": ([2047, 0], [2049, 1]),
}
DTYPE_HEAD_DIMS = {
    "bf16-d128": (torch.bfloat16, 128), "fp16-d64": (torch.float16, 64), "bf16-d256": (torch.bfloat16, 256),
    "fp32-d128": (torch.float32, 128),
}
# The other compiled head sizes: the padded shared-memory pitch (80, 96, 112, 160), the fp32 kernel's padded lanes.
NEW_DTYPE_HEAD_DIMS = {
    "fp16-d32": (torch.float16, 32), "bf16-d80": (torch.bfloat16, 80), "fp16-d96": (torch.float16, 96),
    "bf16-d112": (torch.bfloat16, 112), "fp16-d160": (torch.float16, 160), "bf16-d192": (torch.bfloat16, 192),
    "fp32-d80": (torch.float32, 80), "fp32-d192": (torch.float32, 192),
}
# Sliding windows: shorter than a block, not a multiple of any block size, across decode splits and prefill tiles,
# longer than every context.
WINDOWS = [1, 5, 100, 700, 100_000]


def on_device(meta, query):
    k_cache, v_cache = (t.to(DEVICE) for t in meta.kv_caches[0])
    return meta.on(DEVICE), query.to(DEVICE), k_cache, v_cache


def oracle(meta, query, k_cache, v_cache, num_heads: int, num_kv_heads: int, head_dim: int,
           window: int = 0) -> torch.Tensor:
    """The torch backend in float64, checked against the exact answer before it judges anything."""
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=window or None)
    expected = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                         compute_dtype=torch.float64).cpu()
    exact = exact_position_means(meta, num_heads, num_kv_heads, head_dim, window=window)
    assert torch.allclose(expected, exact, rtol=0, atol=1e-9), "the oracle disagrees with the exact answer"
    return expected


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def check_decode_rows(heads: tuple[int, int], dtype: torch.dtype, head_dim: int, block_size: int,
                      split_lens: tuple[int, ...], windows: tuple[int, ...] = (0,), softcap: float = 0.0) -> None:
    """Decode over DECODE_LENS at each split length (0 = the heuristic) and sliding window (0 = none), with
    max_seq_len the step's longest context and then the table's capacity (a CUDA graph's bound)."""
    num_heads, num_kv_heads = heads
    gen = seeded(block_size, dtype, head_dim, heads)
    meta, query, _, _ = position_step([n - 1 for n in DECODE_LENS], [1] * len(DECODE_LENS), block_size, num_heads,
                                      num_kv_heads, head_dim, dtype, gen)
    meta, query, k_cache, v_cache = on_device(meta, query)
    for window in windows:
        expected = oracle(meta, query, k_cache, v_cache, num_heads, num_kv_heads, head_dim, window)
        allowance = position_allowance(meta, expected, dtype, window)
        for split_len in split_lens:
            for max_seq_len in (meta.max_seqlen_k, meta.block_tables.shape[1] * block_size):
                out = torch.full_like(query, float("nan"))
                kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, head_dim**-0.5,
                                     max_seq_len=max_seq_len, out=out, split_len=split_len, window=window,
                                     softcap=softcap)
                assert_rows_close(out, expected, allowance, f"decode split {split_len} max_seq_len {max_seq_len} "
                                                            f"window {window} softcap {softcap}")


def check_prefill_rows(heads: tuple[int, int], dtype: torch.dtype, head_dim: int, block_size: int,
                       windows: tuple[int, ...] = (0,), softcap: float = 0.0, impl: str = "mma") -> None:
    """Prefill over every PREFILL_SCENARIOS step and sliding window (0 = none), with the automatic choice and every
    tile configuration compiled for the head size (float32, and impl="wgmma", have one path)."""
    num_heads, num_kv_heads = heads
    configs = (-1,) if dtype == torch.float32 or impl != "mma" else (-1, *prefill_configs(head_dim))
    for name, (prefix_lens, new_lens) in PREFILL_SCENARIOS.items():
        gen = seeded(name, block_size, dtype, head_dim, heads)
        meta, query, _, _ = position_step(prefix_lens, new_lens, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                          gen)
        meta, query, k_cache, v_cache = on_device(meta, query)
        for window in windows:
            expected = oracle(meta, query, k_cache, v_cache, num_heads, num_kv_heads, head_dim, window)
            allowance = position_allowance(meta, expected, dtype, window)
            for config in configs:
                out = torch.full_like(query, float("nan"))
                paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                              head_dim**-0.5, max_seqlen_q=meta.max_seqlen_q, out=out, config=config, window=window,
                              softcap=softcap, impl=impl)
                assert_rows_close(out, expected, allowance, f"prefill {impl} {name} config {config} window {window} "
                                                            f"softcap {softcap}")
