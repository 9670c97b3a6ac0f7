"""A small grid of the CUDA kernels for compute-sanitizer (memcheck, racecheck): every kernel variant family once.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/memcheck_small.py

(without the caching allocator each tensor is its own allocation, so an out-of-bounds access is caught). Exits 1
if any output is wrong, so the sanitizer's exit code and ours together say "clean and correct".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from paged_steps import make_paged_step  # noqa: E402

from hf_paged import kernels  # noqa: E402
from hf_paged.attention import AttentionParams  # noqa: E402
from hf_paged.attention.backends._torch import paged_attention_reference  # noqa: E402

# (heads, kv heads, head_dim, block_size, dtype, context lengths, split_len[, sliding window, softcap])
CASES = [
    (32, 8, 128, 16, torch.bfloat16, [1, 17, 300], 0),
    (32, 8, 128, 16, torch.bfloat16, [1, 17, 300], 64),
    (8, 1, 64, 256, torch.float16, [5, 257], 64),
    (32, 32, 64, 8, torch.float16, [3, 100], 64),
    (48, 4, 128, 48, torch.bfloat16, [33, 129], 0),
    (7, 1, 256, 16, torch.float32, [2, 90], 64),
    (32, 8, 80, 16, torch.bfloat16, [1, 17, 300], 64),  # padded shared-memory pitch
    (8, 1, 192, 48, torch.float16, [5, 257], 0),
    (6, 2, 96, 16, torch.float32, [2, 90], 64),  # fp32 lanes padded to 128
    (32, 8, 128, 16, torch.bfloat16, [1, 17, 300], 64, 100, 5.0),  # window across splits, not at a block edge
    (8, 1, 64, 48, torch.float16, [5, 257], 0, 7, 0.0),  # window inside a block
    (6, 2, 96, 16, torch.float32, [2, 90], 64, 30, 5.0),
]


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for heads, kv_heads, head_dim, block_size, dtype, lens, split_len, *options in CASES:
        window, softcap = options or (0, 0.0)
        meta, key, value = make_paged_step([n - 1 for n in lens], [1] * len(lens), block_size, kv_heads, head_dim,
                                           dtype, gen)
        meta = meta.on(torch.device("cuda"))
        k_cache, v_cache = (t.cuda() for t in meta.kv_caches[0])
        query = torch.randn(len(lens), heads, head_dim, generator=gen).to("cuda", dtype)
        params = AttentionParams(scale=head_dim**-0.5, sliding_window=window or None, softcap=softcap or None)
        out = kernels.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, params.scale,
                                   max_seq_len=meta.max_seqlen_k, split_len=split_len, window=window, softcap=softcap)
        ref = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                        compute_dtype=torch.float64)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        # write_kv: put the new tokens back where they came from, after clobbering those slots
        slots = meta.slot_mapping.clone()
        slots[0] = -1
        k_copy = k_cache.clone()
        kernels.write_kv(key.cuda() + 1, value.cuda(), k_copy, v_cache.clone(), slots)
        wrote = torch.equal(k_copy.view(-1, kv_heads, head_dim)[slots[1:]], key[1:].cuda() + 1)
        ok = rel < 1e-2 and wrote and not out.isnan().any()
        failures += not ok
        print(f"{'ok ' if ok else 'BAD'} heads {heads}/{kv_heads} d{head_dim} bs{block_size} {dtype} lens {lens} "
              f"split {split_len} window {window} softcap {softcap}: rel {rel:.1e}, "
              f"write {'exact' if wrote else 'WRONG'}")
    failures += fp8_cases(gen)
    failures += fp8_prefill_case(gen)
    torch.cuda.synchronize()
    return 1 if failures else 0


# (heads, kv heads, head_dim, block_size, query dtype, context lengths, split_len, window, softcap)
FP8_CASES = [
    (32, 8, 128, 16, torch.bfloat16, [1, 17, 300], 64, 0, 0.0),
    (8, 1, 64, 48, torch.float16, [5, 257], 0, 0, 0.0),
    (16, 4, 256, 16, torch.bfloat16, [2, 90], 64, 30, 5.0),
]


def fp8_cases(gen: torch.Generator) -> int:
    """The e4m3 decode kernel and the quantizing write, against float64 attention over the dequantized cache and
    the torch write byte for byte."""
    from hf_paged.cache import _kv_quant as kv_quant
    from hf_paged.cache._kv_quant import KVScales

    failures = 0
    for heads, kv_heads, head_dim, block_size, dtype, lens, split_len, window, softcap in FP8_CASES:
        meta, key, value = make_paged_step([n - 1 for n in lens], [1] * len(lens), block_size, kv_heads, head_dim,
                                           torch.float32, gen)
        meta = meta.on(torch.device("cuda"))
        scales = KVScales.unset(kv_heads, torch.device("cuda"))
        quantized = []
        for cache, scale in zip(meta.kv_caches[0], (scales.k, scales.v)):
            flat = cache.cuda().flatten(0, 1)
            kv_quant.fix_unset_scales(scale, flat.clamp(-8, 8))  # POISON slots saturate, read would show
            quantized.append(kv_quant.quantize(flat, scale).view(cache.shape))
        k8, v8 = quantized
        query = torch.randn(len(lens), heads, head_dim, generator=gen).to("cuda", dtype)
        params = AttentionParams(scale=head_dim**-0.5, sliding_window=window or None, softcap=softcap or None)
        out = kernels.paged_decode(query, k8, v8, meta.block_tables, meta.seq_lens_k, params.scale,
                                   max_seq_len=meta.max_seqlen_k, split_len=split_len, window=window, softcap=softcap,
                                   k_scale=scales.k, v_scale=scales.v)
        k_deq = k8.double() * scales.k.double()[:, None]
        v_deq = v8.double() * scales.v.double()[:, None]
        ref = paged_attention_reference(query.double(), k_deq, v_deq, meta, params, compute_dtype=torch.float64)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        # the quantizing write into fresh slots (and a padding row, -1) against torch's quantize with the same scales
        slots = meta.slot_mapping.clone()
        slots[0] = -1
        k_copy, v_copy = k8.clone(), v8.clone()
        kernels.write_kv(key.cuda().to(dtype), value.cuda().to(dtype), k_copy, v_copy, slots, k_scale=scales.k,
                         v_scale=scales.v)
        want = kv_quant.quantize(key.cuda().to(dtype)[1:].float(), scales.k)
        got = k_copy.view(-1, kv_heads, head_dim)[slots[1:]]
        wrote = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        ok = rel < 2e-2 and wrote and not out.isnan().any()
        failures += not ok
        print(f"{'ok ' if ok else 'BAD'} fp8 heads {heads}/{kv_heads} d{head_dim} bs{block_size} {dtype} lens {lens} "
              f"split {split_len} window {window} softcap {softcap}: rel {rel:.1e}, "
              f"write {'exact' if wrote else 'WRONG'}")
    return failures


def fp8_prefill_case(gen: torch.Generator) -> int:
    """The e4m3 prefill kernel (every tile configuration of head_dim 128, bf16, GQA, block size 48, prompts and an
    extend across 64-key tiles; plain, then with window 30 and softcap 5) against float64 attention over the
    dequantized cache."""
    from hf_paged.cache import _kv_quant as kv_quant
    from hf_paged.cache._kv_quant import KVScales
    from hf_paged.kernels._prefill import paged_prefill, prefill_configs

    meta, _, _ = make_paged_step([0, 70, 3], [1, 90, 130], 48, 2, 128, torch.float32, gen)
    meta = meta.on(torch.device("cuda"))
    scales = KVScales.unset(2, torch.device("cuda"))
    quantized = []
    for cache, scale in zip(meta.kv_caches[0], (scales.k, scales.v)):
        flat = cache.cuda().flatten(0, 1)
        kv_quant.fix_unset_scales(scale, flat.clamp(-8, 8))  # POISON slots saturate, a read would show
        quantized.append(kv_quant.quantize(flat, scale).view(cache.shape))
    k8, v8 = quantized
    query = torch.randn(int(meta.cu_seqlens_q[-1]), 8, 128, generator=gen).to("cuda", torch.bfloat16)
    k_deq, v_deq = kv_quant.dequantize(k8, scales.k, torch.float64), kv_quant.dequantize(v8, scales.v, torch.float64)
    failures = 0
    for window, softcap in ((0, 0.0), (30, 5.0)):
        params = AttentionParams(scale=128**-0.5, sliding_window=window or None, softcap=softcap or None)
        ref = paged_attention_reference(query.double(), k_deq, v_deq, meta, params, compute_dtype=torch.float64)
        for config in (-1, *prefill_configs(128)):
            out = paged_prefill(query, k8, v8, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, params.scale,
                                max_seqlen_q=meta.max_seqlen_q, config=config, window=window, softcap=softcap,
                                k_scale=scales.k, v_scale=scales.v)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            ok = rel < 2e-2 and not out.isnan().any()
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} fp8 prefill d128 bs48 bf16 config {config} window {window} "
                  f"softcap {softcap}: rel {rel:.1e}")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
