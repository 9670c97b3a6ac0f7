"""The decode and prefill kernels judged row by row on inputs whose answer is exact (tests/kernel_oracle.py).

Keys are zero and values encode their position, so every (row, head) of the output is the exact mean of the visible
keys' values: one key dropped or read twice at a block, split or tile boundary fails that row (tests/
test_kernel_oracle.py proves the check catches it). Contexts end on and around every boundary of 8/16/48/256-token
blocks, decode splits (forced 64/192/512 and the heuristic) and the prefill kernel's 64-key and 64/128-row tiles, at
head sizes from 32 to 256 (issue 11), each prefill configuration compiled for the size.
The torch backend in float64 is the oracle here (and must itself equal the exact answer); it is not under test.
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hf_paged import kernels  # noqa: E402
from hf_paged.attention import AttentionParams  # noqa: E402
from hf_paged.attention.backends.torch_backend import paged_attention_reference  # noqa: E402
from hf_paged.kernels.prefill import paged_prefill, prefill_configs  # noqa: E402

from kernel_oracle import assert_rows_close, exact_position_means, position_allowance, position_step  # noqa: E402

if kernels.unavailable_reason() is not None:
    pytest.skip(f"hf_paged kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)

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


def on_device(meta, query):
    k_cache, v_cache = (t.to(DEVICE) for t in meta.kv_caches[0])
    return meta.on(DEVICE), query.to(DEVICE), k_cache, v_cache


def oracle(meta, query, k_cache, v_cache, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The torch backend in float64, checked against the exact answer before it judges anything."""
    expected = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta,
                                         AttentionParams(scale=head_dim**-0.5), compute_dtype=torch.float64).cpu()
    exact = exact_position_means(meta, num_heads, num_kv_heads, head_dim)
    assert torch.allclose(expected, exact, rtol=0, atol=1e-9), "the oracle disagrees with the exact answer"
    return expected


DTYPE_HEAD_DIMS = {
    "bf16-d128": (torch.bfloat16, 128), "fp16-d64": (torch.float16, 64), "bf16-d256": (torch.bfloat16, 256),
    "fp32-d128": (torch.float32, 128),
}
# Issue 11's other head sizes: the padded shared-memory pitch (80, 96, 112, 160), the fp32 kernel's padded lanes.
NEW_DTYPE_HEAD_DIMS = {
    "fp16-d32": (torch.float16, 32), "bf16-d80": (torch.bfloat16, 80), "fp16-d96": (torch.float16, 96),
    "bf16-d112": (torch.bfloat16, 112), "fp16-d160": (torch.float16, 160), "bf16-d192": (torch.bfloat16, 192),
    "fp32-d80": (torch.float32, 80), "fp32-d192": (torch.float32, 192),
}


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("dtype, head_dim", NEW_DTYPE_HEAD_DIMS.values(), ids=NEW_DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("split_len", [0, 64, 512], ids=lambda s: f"split{s}")
def test_decode_rows_are_exact_means_at_other_head_sizes(split_len: int, block_size: int, dtype: torch.dtype,
                                                         head_dim: int, heads):
    test_decode_rows_are_exact_means(split_len, block_size, dtype, head_dim, heads)


@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (12, 12)], ids=["gqa-32/8", "mqa-8/1", "mha-12/12"])
@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS.values(), ids=DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
@pytest.mark.parametrize("split_len", [0, 64, 192, 512], ids=lambda s: f"split{s}")
def test_decode_rows_are_exact_means(split_len: int, block_size: int, dtype: torch.dtype, head_dim: int, heads):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(zlib.crc32(repr((split_len, block_size, dtype, head_dim, heads)).encode()))
    meta, query, _, _ = position_step([n - 1 for n in DECODE_LENS], [1] * len(DECODE_LENS), block_size, num_heads,
                                      num_kv_heads, head_dim, dtype, gen)
    exact = exact_position_means(meta, num_heads, num_kv_heads, head_dim)
    meta, query, k_cache, v_cache = on_device(meta, query)
    expected = oracle(meta, query, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    allowance = position_allowance(meta, exact, dtype)
    # max_seq_len as the step's longest context, then as the table's capacity (a CUDA graph's bound)
    for max_seq_len in (meta.max_seqlen_k, meta.block_tables.shape[1] * block_size):
        out = torch.full_like(query, float("nan"))
        kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, head_dim**-0.5,
                             max_seq_len=max_seq_len, out=out, split_len=split_len)
        assert_rows_close(out, expected, allowance, f"decode split {split_len} max_seq_len {max_seq_len}")


# (dtype, head_dim, tile configuration): each configuration compiled per size; float32 has one path (-1).
PREFILL_CASES = [(dtype, d, c) for dtype, d in (*DTYPE_HEAD_DIMS.values(), *NEW_DTYPE_HEAD_DIMS.values())
                 for c in ((-1,) if dtype == torch.float32 else (-1, *prefill_configs(d)))]


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("dtype, head_dim, config", PREFILL_CASES,
                         ids=[f"{str(t).split('.')[-1]}-d{d}-config{c}" for t, d, c in PREFILL_CASES])
@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_prefill_rows_are_exact_means(config: int, block_size: int, dtype: torch.dtype, head_dim: int, heads):
    num_heads, num_kv_heads = heads
    for name, (prefix_lens, new_lens) in PREFILL_SCENARIOS.items():
        gen = torch.Generator().manual_seed(zlib.crc32(repr((name, config, block_size, dtype, heads)).encode()))
        meta, query, _, _ = position_step(prefix_lens, new_lens, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                          gen)
        exact = exact_position_means(meta, num_heads, num_kv_heads, head_dim)
        meta, query, k_cache, v_cache = on_device(meta, query)
        expected = oracle(meta, query, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
        out = torch.full_like(query, float("nan"))
        paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                      head_dim**-0.5, max_seqlen_q=meta.max_seqlen_q, out=out, config=config)
        assert_rows_close(out, expected, position_allowance(meta, exact, dtype), f"prefill {name}")
