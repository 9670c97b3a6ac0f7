"""The flash backend on a GPU with the real flash-attn 2, against the torch oracle computed in float64 there.

Skipped unless CUDA is available and flash-attn imports. Block size 256 (flash-attn 2's paged-KV requirement);
prefix/new lengths include 1, block-size multiples and others, so sequences end mid-block and cross blocks.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from paged_steps import make_paged_step

from hf_paged.attention import AttentionCall, AttentionInputs, AttentionParams, Dispatcher, Phase
from hf_paged.attention.backends import _flash as flash
from hf_paged.attention.backends._torch import paged_attention_reference

if flash.load_flash_attn() is None:
    pytest.skip(flash._import_error or "flash-attn unavailable", allow_module_level=True)

DEVICE = torch.device("cuda")
BLOCK_SIZE = 256
NUM_HEADS, NUM_KV_HEADS = 32, 8
STEPS = {  # phase, cached prefix lengths, new-token counts
    "prefill": (Phase.PREFILL, [0, 0, 0, 0], [1, 300, 45, 777]),
    "extend": (Phase.EXTEND, [300, 0, 255, 17, 1, 512], [5, 140, 3, 1, 260, 257]),
    "decode": (Phase.DECODE, [0, 1, 255, 256, 511, 1500], [1, 1, 1, 1, 1, 1]),
}
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 100},
    "softcap": {"softcap": 2.0},
}
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative (Frobenius) error vs the float64 oracle


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free memory, so an output the kernel fails to write reads as NaN."""
    junk = torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device=DEVICE)
    del junk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_flash_matches_float64_reference_on_gpu(step, features: dict, head_dim: int, dtype: torch.dtype):
    phase, prefix_lens, new_lens = step
    gen = torch.Generator().manual_seed(zlib.crc32(repr((phase.value, features, head_dim, dtype)).encode()))
    meta, key, value = make_paged_step(prefix_lens, new_lens, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype, gen)
    assert meta.phase is phase
    k_cache, v_cache = (t.to(DEVICE) for t in meta.kv_caches[0])
    meta, key, value = meta.on(DEVICE), key.to(DEVICE), value.to(DEVICE)
    query = torch.randn(meta.num_tokens, NUM_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=features.get("sliding_window"),
                             softcap=features.get("softcap"))
    call = AttentionCall(phase, "cuda", dtype, head_dim, NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE,
                         params.sliding_window, params.softcap)
    assert Dispatcher().select(call).name == "flash"

    _poison_allocator(query.numel() * query.element_size())
    out = flash.FlashBackend().forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params), None)
    expected = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                         compute_dtype=torch.float64)

    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "flash left outputs unwritten (NaN) or overflowed"
    rel = ((out.double() - expected).norm() / expected.norm()).item()
    assert rel < TOLERANCE[dtype], f"relative error {rel:.2e} vs the float64 reference"


@pytest.mark.parametrize("phase", [Phase.EXTEND, Phase.DECODE])
def test_small_blocks_go_elsewhere_for_paged_reads(phase: Phase):
    call = AttentionCall(phase, "cuda", torch.bfloat16, 128, NUM_HEADS, NUM_KV_HEADS, 16)
    assert "block_size % 256" in flash.FlashBackend().unsupported_reason(call)
    assert Dispatcher().select(call).name != "flash"
