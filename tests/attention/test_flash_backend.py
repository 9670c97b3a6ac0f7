"""The flash backend on CPU, with ``flash_attn`` replaced by a float64 double of its documented semantics
(``tests/helpers/flash_double.py``): dispatch rules, outputs against the torch oracle, and greedy ``generate`` vs
eager."""

from __future__ import annotations

import sys
import zlib

import flash_double
import pytest
import torch
from paged_steps import make_paged_step
from tiny_models import EOS, PAD, left_padded_batch, make_models

import hf_paged
from hf_paged.attention import AttentionCall, AttentionInputs, AttentionParams, Dispatcher, Phase
from hf_paged.attention.backends import _flash as flash
from hf_paged.attention.backends._torch import paged_attention_reference
from hf_paged.hf.compat import with_cache


def _reset_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash, "_flash_attn", flash._NOT_LOADED)
    monkeypatch.setattr(flash, "_import_error", None)
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch):
    """Install the double as ``flash_attn`` and let the flash backend serve CPU (float32 included)."""
    monkeypatch.setitem(sys.modules, "flash_attn", flash_double)
    _reset_import(monkeypatch)
    monkeypatch.setattr(flash, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(flash, "_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    return flash_double


def _call(phase: Phase, block_size: int, dtype=torch.float16, head_dim: int = 64) -> AttentionCall:
    return AttentionCall(phase=phase, device_type="cpu", dtype=dtype, head_dim=head_dim,
                         num_heads=8, num_kv_heads=2, block_size=block_size)


# ----- (a) dispatch ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 128, 256, 512])
@pytest.mark.parametrize("phase", list(Phase))
def test_dispatcher_uses_flash_where_flash_attn_can_serve(double, phase: Phase, block_size: int):
    expected = "flash" if phase is Phase.PREFILL or block_size % 256 == 0 else "torch"
    assert Dispatcher().select(_call(phase, block_size)).name == expected


def test_pinned_flash_refuses_small_paged_blocks(double):
    with pytest.raises(NotImplementedError, match="block_size % 256 == 0"):
        Dispatcher("flash").select(_call(Phase.DECODE, 16))


@pytest.mark.parametrize("head_dim", [4, 100, 512])
def test_flash_refuses_unserved_head_dims(double, head_dim: int):
    assert Dispatcher().select(_call(Phase.PREFILL, 256, head_dim=head_dim)).name == "torch"


def test_flash_refuses_cpu_and_float32_outside_the_test_hook(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_double)
    _reset_import(monkeypatch)
    backend = flash.FlashBackend()
    assert "cuda" in backend.unsupported_reason(_call(Phase.PREFILL, 256))
    cuda_fp32 = AttentionCall(Phase.PREFILL, "cuda", torch.float32, 64, 8, 2, 256)
    assert "float16 or bfloat16" in backend.unsupported_reason(cuda_fp32)
    assert Dispatcher().select(_call(Phase.PREFILL, 256)).name == "torch"


def test_missing_flash_attn_names_the_install_command(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    _reset_import(monkeypatch)
    monkeypatch.setattr(flash, "_DEVICE_TYPES", ("cuda", "cpu"))
    reason = flash.FlashBackend().unsupported_reason(_call(Phase.PREFILL, 256))
    assert reason == "flash-attn is not installed (pip install hf-paged[flash])"
    assert Dispatcher().select(_call(Phase.PREFILL, 256)).name == "torch"


# ----- (b) outputs equal the torch oracle -----------------------------------------------------------------------
# phase, block_size, cached prefix lengths, new-token counts (lengths 1, block-size multiples and others)
STEPS = {
    "prefill-bs16": (Phase.PREFILL, 16, [0, 0, 0, 0], [1, 37, 16, 70]),
    "prefill-bs256": (Phase.PREFILL, 256, [0, 0, 0], [1, 300, 45]),
    "extend": (Phase.EXTEND, 256, [300, 0, 255, 17, 1, 256], [5, 40, 3, 1, 260, 1]),
    "decode": (Phase.DECODE, 256, [0, 1, 255, 256, 511, 700], [1, 1, 1, 1, 1, 1]),
}
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 7},
    "long-window": {"sliding_window": 300},
    "softcap": {"softcap": 2.0},
    "all": {"sliding_window": 33, "softcap": 2.0},
}
HEADS = {"gqa-4/2-d16": (4, 2, 16), "mqa-8/1-d64": (8, 1, 64), "mha-3/3-d8": (3, 3, 8)}


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_flash_matches_torch_reference(double, step, features: dict, heads: tuple[int, int, int]):
    phase, block_size, prefix_lens, new_lens = step
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(zlib.crc32(repr((phase.value, block_size, features, heads)).encode()))
    meta, key, value = make_paged_step(prefix_lens, new_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    assert meta.phase is phase
    query = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen)
    params = AttentionParams(scale=1.3 * head_dim**-0.5, sliding_window=features.get("sliding_window"),
                             softcap=features.get("softcap"))
    k_cache, v_cache = meta.kv_caches[0]
    out = flash.FlashBackend().forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params), None)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, params, compute_dtype=torch.float64)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_flash_matches_torch_reference_half(double, step, dtype: torch.dtype):
    phase, block_size, prefix_lens, new_lens = step
    gen = torch.Generator().manual_seed(7)
    meta, key, value = make_paged_step(prefix_lens, new_lens, block_size, 2, 32, dtype, gen)
    query = torch.randn(meta.num_tokens, 8, 32, generator=gen).to(dtype)
    params = AttentionParams(scale=32**-0.5, sliding_window=20)
    k_cache, v_cache = meta.kv_caches[0]
    out = flash.FlashBackend().forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params), None)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, params, compute_dtype=torch.float64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected.double(), rtol=1e-2, atol=1e-2)


# ----- (c) the double behaves as documented -------------------------------------------------------------------
def test_double_refuses_paged_blocks_not_divisible_by_256():
    cache = torch.zeros(4, 16, 2, 8)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    q = torch.zeros(1, 1, 2, 8)
    with pytest.raises(RuntimeError, match="Paged KV cache block size must be divisible by 256"):
        flash_double.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([20], dtype=torch.int32),
                                             block_table=table, causal=True)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Paged KV cache block size must be divisible by 256"):
        flash_double.flash_attn_varlen_func(q[0], cache, cache, cu, torch.tensor([0, 20], dtype=torch.int32),
                                            1, 20, causal=True, block_table=table)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, mask",
    [  # flash-attn's documented bottom-right causal masks (1 = keep); an all-zero row outputs zeros
        (2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]),
    ],
)
def test_double_causal_mask_is_bottom_right_aligned(seqlen_q: int, seqlen_k: int, mask: list[list[int]]):
    # Zero queries attend uniformly to what they see; one-hot values make the output that visible set.
    q = torch.zeros(seqlen_q, 1, 8)
    k = torch.randn(seqlen_k, 1, 8)
    v = torch.zeros(seqlen_k, 1, 8)
    v[:, 0, :seqlen_k] = torch.eye(seqlen_k)
    out = flash_double.flash_attn_varlen_func(
        q, k, v, torch.tensor([0, seqlen_q], dtype=torch.int32), torch.tensor([0, seqlen_k], dtype=torch.int32),
        seqlen_q, seqlen_k, causal=True,
    )
    keep = torch.tensor(mask, dtype=torch.float32)
    expected = keep / keep.sum(1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(out[:, 0, :seqlen_k], expected)


# ----- (d) end to end: greedy generate equals eager ------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, block_size, decode_backend",
    [  # llama_gqa: hidden 64, 2 layers, 4 heads, 2 KV heads; mistral adds a sliding window, gemma2 also softcap
        ("llama_gqa", 256, "flash"), ("llama_gqa", 16, "torch"), ("mistral", 256, "flash"), ("gemma2", 256, "flash"),
    ],
)
def test_generate_with_flash_double_equals_eager(double, arch: str, block_size: int, decode_backend: str):
    eager, paged = make_models(arch)  # float32
    # 250 prompt + 12 new tokens crosses a 256-token block; lengths 1 and 9 sit inside one.
    batch = left_padded_batch([250, 1, 9, 17], torch.Generator().manual_seed(3))
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=block_size, dtype=torch.float32)
    with torch.no_grad():
        expected = eager.generate(**batch, **greedy)
        out = paged.generate(**with_cache(paged, cache, **batch), **greedy)
    assert torch.equal(out, expected)
    backends = cache.stats()["backends"]
    assert backends["prefill"] == "flash"
    assert backends["decode"] == decode_backend
