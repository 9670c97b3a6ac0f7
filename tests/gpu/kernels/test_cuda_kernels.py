"""hf_paged's CUDA kernels (and every other backend that runs here) against the float64 torch oracle, on a GPU.

The decode grid: batch 1..256, context lengths 1, block-size multiples and others (sequences end mid-block),
heads/kv heads 32/8, 32/32, 8/1, head_dim 64/128, block sizes 16 and 256, fp16/bf16; and every compiled head size
(32 to 256, fp16/bf16/fp32, block sizes 16 and 48). Each case draws fresh inputs; the cache holds ``POISON`` in
slots no sequence owns; outputs are NaN-poisoned first. Each output is judged over the whole batch and row by row
(tests/helpers/kernel_oracle.py); test_kernel_rows_*.py add inputs with exact answers. The torch backend is the
oracle, not a backend under test.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_steps import (DEVICE, TOLERANCE, check, decode_step, reference, relative_error, run_decode,
                          runnable_backends)

from hf_paged import kernels
from hf_paged.attention import AttentionCall, AttentionInputs, Dispatcher, Phase

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

HEADS = {"gqa-32/8": (32, 8), "mha-32/32": (32, 32), "mqa-8/1": (8, 1)}


def scenarios(gen: torch.Generator) -> dict[str, list[int]]:
    """Context lengths (new token included) per sequence."""
    return {
        "b1-ctx1": [1],
        "b1-long": [6001],
        "b7-edges": [1, 16, 17, 255, 256, 257, 1000],
        "b256-random": torch.randint(1, 400, (256,), generator=gen).tolist(),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_decode_matches_float64_reference(heads, head_dim: int, block_size: int, dtype: torch.dtype):
    check_every_backend(heads, head_dim, block_size, dtype, scenarios)


def edge_scenarios(gen: torch.Generator) -> dict[str, list[int]]:
    """Fewer, shorter contexts than ``scenarios`` (the every-head-size grid is wide): tile, block and split edges."""
    return {"b1-ctx1": [1], "b9-edges": [1, 16, 17, 47, 48, 49, 511, 513, 2500],
            "b64-random": torch.randint(1, 300, (64,), generator=gen).tolist()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("head_dim", kernels.HEAD_DIMS)
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
def test_decode_every_head_size(heads, head_dim: int, block_size: int, dtype: torch.dtype):
    """Every compiled head size: the padded shared-memory pitch (80, 96, 112, 160), the fp32 kernel's padded lanes
    (80 to 192), and 32/192/256 at both dtypes."""
    check_every_backend(heads, head_dim, block_size, dtype, edge_scenarios)


def check_every_backend(heads, head_dim: int, block_size: int, dtype: torch.dtype, make_scenarios) -> None:
    """Our kernel and every other backend that serves the call against the float64 oracle, scenario by scenario."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(zlib.crc32(repr((heads, head_dim, block_size, dtype)).encode()))
    call = AttentionCall(Phase.DECODE, "cuda", dtype, head_dim, num_heads, num_kv_heads, block_size)
    backends = runnable_backends(call)
    assert "cuda" in [b.name for b in backends]
    for name, ctx_lens in make_scenarios(gen).items():
        meta, query, key, value, k_cache, v_cache, params = decode_step(
            ctx_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, gen)
        expected = reference(query, k_cache, v_cache, meta, params)
        results = {"cuda-kernel": run_decode(query, k_cache, v_cache, meta, params)}
        for backend in backends:
            inputs = AttentionInputs(query, key, value, k_cache, v_cache, meta, params)
            results[backend.name] = backend.forward(inputs, backend.plan(meta))
        for who, out in results.items():
            assert out.shape == query.shape and out.dtype == dtype, (who, name)
            check(out, expected, dtype, f"{who} on {name}")


@pytest.mark.parametrize("split_len", [0, 64, 128, 1024])
@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
def test_decode_forced_splits(split_len: int, block_size: int):
    """Many splits per sequence (the last-CTA combine) and block sizes that do not divide the split."""
    gen = torch.Generator().manual_seed(split_len * 1000 + block_size)
    lens = [1, 63, 64, 65, 700, 3001, 5000]
    meta, query, _, _, k_cache, v_cache, params = decode_step(lens, block_size, 32, 8, 128, torch.bfloat16, gen)
    expected = reference(query, k_cache, v_cache, meta, params)
    for _ in range(2):  # a second launch must find the split tickets reset
        out = run_decode(query, k_cache, v_cache, meta, params, split_len)
        check(out, expected, torch.bfloat16, f"split {split_len}")


@pytest.mark.parametrize("heads", [(28, 4), (40, 8), (48, 4), (64, 2), (6, 2), (4, 4)], ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", kernels.HEAD_DIMS)
def test_decode_other_group_sizes_and_fp32(heads, dtype: torch.dtype, head_dim: int):
    """Groups of 7, 5, 12, 32 (several CTAs per kv head), 3, 1 query heads per kv head; fp32 at fp32 accuracy."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((heads, dtype, head_dim)).encode()))
    meta, query, _, _, k_cache, v_cache, params = decode_step([1, 40, 333, 2050], 16, *heads, head_dim, dtype, gen)
    check(run_decode(query, k_cache, v_cache, meta, params), reference(query, k_cache, v_cache, meta, params), dtype,
          f"heads {heads}")


def test_decode_reads_max_seq_len_when_not_given():
    gen = torch.Generator().manual_seed(3)
    meta, query, _, _, k_cache, v_cache, params = decode_step([5, 900], 16, 32, 8, 128, torch.float16, gen)
    out = kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, params.scale)
    assert relative_error(out, reference(query, k_cache, v_cache, meta, params)) < TOLERANCE[torch.float16]


def test_decode_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(4)
    meta, query, _, _, k_cache, v_cache, params = decode_step([5, 9], 16, 32, 8, 128, torch.float16, gen)
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k.long(), 0.1, max_seq_len=9)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode(query.float(), k_cache, v_cache, meta.block_tables, meta.seq_lens_k, 0.1, max_seq_len=9)
    with pytest.raises(NotImplementedError, match="head_dim"):
        kernels.paged_decode(query[..., :120].contiguous(), k_cache[..., :120].contiguous(),
                             v_cache[..., :120].contiguous(), meta.block_tables, meta.seq_lens_k, 0.1, max_seq_len=9)
    with pytest.raises(ValueError, match="too few"):
        kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, 0.1, max_seq_len=10**6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 192])
def test_write_kv_is_exact(dtype: torch.dtype, head_dim: int):
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    num_blocks, block_size, kv_heads, tokens = 600, 16, 8, 4096
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE, generator=gen)[:tokens]
    slots[torch.rand(tokens, device=DEVICE, generator=gen) < 0.1] = -1
    # key as a strided view ([T, Hkv, D] out of [Hkv, T, D]), value contiguous
    key = torch.randn(kv_heads, tokens, head_dim, device=DEVICE, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], key[keep])
    expected_v.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], value[keep])
    kernels.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("block_size", [16, 256])
def test_dispatcher_sends_decode_and_prefill_to_cuda(block_size: int):
    decode = AttentionCall(Phase.DECODE, "cuda", torch.bfloat16, 128, 32, 8, block_size)
    prefill = AttentionCall(Phase.PREFILL, "cuda", torch.bfloat16, 128, 32, 8, block_size)
    chosen = Dispatcher().select(decode).name
    assert chosen == "cuda" or (chosen == "flash" and block_size == 256)
    # flash-attn's PREFILL reads the new K/V only, so it serves any block size; else the prefill kernel serves
    chosen = Dispatcher().select(prefill).name
    assert chosen == "cuda" or chosen == "flash"
    assert Dispatcher().writer(torch.empty(1, block_size, 8, 128, dtype=torch.bfloat16, device=DEVICE)).name in (
        "cuda", "flash")


def test_size_one_dimensions_may_carry_any_stride():
    """Compiled code leaves the stride of a size-1 dimension arbitrary (one KV head per tensor-parallel rank, one
    decode token): the KV write and the decode take such views and give what they give for contiguous copies."""
    gen = torch.Generator().manual_seed(3)
    k_base, v_base = (torch.randn(5 * 24, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    key, value = (torch.as_strided(b, (5, 1, 16), (24, 7, 1)) for b in (k_base, v_base))  # stride(1) != head_dim
    slots = torch.tensor([3, 17, 18, 40, 2], device=DEVICE)
    caches = {name: [torch.zeros(4, 16, 1, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
              for name in ("strided", "contiguous")}
    kernels.write_kv(key, value, *caches["strided"], slots)
    kernels.write_kv(key.contiguous(), value.contiguous(), *caches["contiguous"], slots)
    assert all(torch.equal(a, b) for a, b in zip(caches["strided"], caches["contiguous"]))
    assert torch.equal(caches["strided"][0].view(-1, 1, 16)[slots], key)

    k_cache, v_cache = (torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    q_base = torch.randn(8 * 64 + 8, generator=gen).to(DEVICE, torch.bfloat16)
    query = torch.as_strided(q_base, (1, 8, 64), (3, 64, 1))  # one token: stride(0) is no multiple of a vector
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([37], dtype=torch.int32, device=DEVICE)
    out = kernels.paged_decode(query, k_cache, v_cache, tables, lens, 0.125, max_seq_len=37)
    want = kernels.paged_decode(query.contiguous(), k_cache, v_cache, tables, lens, 0.125, max_seq_len=37)
    assert torch.equal(out, want)
