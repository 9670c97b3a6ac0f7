"""Which backend serves an fp8 (e4m3) KV cache, without a GPU: the cuda backend takes every phase (decode, prefill,
extend) of fp16/bf16 models at the compiled head sizes and the KV write, torch the rest, flash refuses it, and the
scales reach the kernels' arguments."""

from __future__ import annotations

import re

import pytest
import torch

import hf_paged
from hf_paged import kernels
from hf_paged.attention import AttentionInputs, AttentionParams, Dispatcher, Phase
from hf_paged.cache import _kv_quant as kv_quant
from hf_paged.attention.backends.base import AttentionCall
from hf_paged.attention.backends import _cuda as cuda_backend
from hf_paged.attention.backends._cuda import CudaBackend
from hf_paged.attention.backends._flash import FlashBackend
from hf_paged.cache._kv_quant import FP8_DTYPE, FP8_NOT_SERVED_HERE, KVScales
from hf_paged.kernels import _build as build
from hf_paged.kernels._prefill import paged_prefill
from paged_steps import random_paged_step
from tiny_models import make_config


def _call(phase: Phase = Phase.DECODE, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> AttentionCall:
    return AttentionCall(phase=phase, device_type="cuda", dtype=dtype, head_dim=head_dim, num_heads=32,
                         num_kv_heads=8, block_size=16, kv_dtype=FP8_DTYPE)


@pytest.fixture
def kernels_ready(monkeypatch: pytest.MonkeyPatch):
    """As on a GPU box whose kernels built."""
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: None)
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)


PHASES = (Phase.DECODE, Phase.PREFILL, Phase.EXTEND)


def test_cuda_serves_every_fp8_phase_and_the_write_and_torch_the_other_models(kernels_ready):
    cuda = CudaBackend()
    for phase in PHASES:
        for dtype in kernels.FP8_QUERY_DTYPES:
            for head_dim in kernels.FP8_HEAD_DIMS:
                assert cuda.unsupported_reason(_call(phase, dtype, head_dim)) is None, (phase, dtype, head_dim)
        assert (f"fp8 KV {phase.value} is compiled for float16 and bfloat16 models"
                in cuda.unsupported_reason(_call(phase, dtype=torch.float32)))
        assert "head_dim 64, 128, 256, not 80" in cuda.unsupported_reason(_call(phase, head_dim=80))
    assert cuda.write_unsupported_reason("cuda", FP8_DTYPE, 64) is None
    assert cuda.write_unsupported_reason("cuda", FP8_DTYPE, 72) is None  # any whole 8-element groups
    assert "multiple of 8" in cuda.write_unsupported_reason("cuda", FP8_DTYPE, 12)
    assert "not a CUDA device" in cuda.write_unsupported_reason("cpu", FP8_DTYPE, 64)

    dispatcher = Dispatcher()
    for phase in PHASES:
        assert dispatcher.select(_call(phase)).name == "cuda", phase
        assert dispatcher.select(_call(phase, dtype=torch.float32)).name == "torch", phase
        assert dispatcher.select(_call(phase, head_dim=80)).name == "torch", phase
    assert dispatcher._writer_for(("cuda", FP8_DTYPE, 128)).name == "cuda"
    # The engine's CUDA graphs and a compileable cache ask this before capturing decode steps.
    assert dispatcher.capture_unsupported_reason([_call()], FP8_DTYPE) is None
    # A float32 model's fp8 decode stays on torch, whose KV write is not capture-safe.
    assert "not capture-safe" in Dispatcher().capture_unsupported_reason([_call(dtype=torch.float32)], FP8_DTYPE)


def test_flash_refuses_fp8_and_cuda_alone_cannot_serve_a_float32_models_fp8_cache():
    for phase in PHASES:
        assert FlashBackend().unsupported_reason(_call(phase)) == FP8_NOT_SERVED_HERE
    assert FlashBackend().write_unsupported_reason("cuda", FP8_DTYPE, 64) is not None  # (no KV write of its own)
    assert Dispatcher(("flash", "torch"))._writer_for(("cuda", FP8_DTYPE, 64)).name == "torch"
    with pytest.raises(NotImplementedError, match="compiled for float16 and bfloat16 models, not torch.float32"):
        hf_paged.PagedAttentionCache(make_config("llama_gqa"), num_blocks=4, backend="cuda", kv_cache_dtype="fp8",
                                     dtype=torch.float32)


class _Recorder:
    """Stands in for a kernel entry point: keeps its arguments."""

    def __init__(self, result=None):
        self.calls, self.result = [], result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


def _fp8_step(q_lens: tuple[int, ...] = (1, 1)):
    """A step over an e4m3 cache (decode by default; longer ``q_lens`` give an extend) with its scales, on the CPU."""
    gen = torch.Generator().manual_seed(0)
    query, k_cache, v_cache, meta, _ = random_paged_step(list(q_lens), [9, 30], 8, 2, 64, 16, gen,
                                                         dtype=torch.bfloat16)
    scales = KVScales.unset(2, torch.device("cpu"))
    caches = []
    for cache, scale in ((k_cache, scales.k), (v_cache, scales.v)):
        kv_quant.fix_unset_scales(scale, cache.flatten(0, 1))
        caches.append(kv_quant.quantize(cache.flatten(0, 1), scale).view(cache.shape))
    return query, *caches, meta, scales


def test_cuda_backend_hands_the_layer_scales_to_decode_and_write(monkeypatch):
    query, k8, v8, meta, scales = _fp8_step()
    decode, write = _Recorder(torch.zeros_like(query)), _Recorder()
    monkeypatch.setattr(kernels, "paged_decode", decode)
    monkeypatch.setattr(kernels, "write_kv", write)
    monkeypatch.setattr(kernels, "decode_split_len", lambda *args: 512)
    cuda = CudaBackend()
    params = AttentionParams(scale=0.125)
    cuda.forward(AttentionInputs(query, None, None, k8, v8, meta, params, scales), cuda.plan(meta))
    (args, kwargs), = decode.calls
    assert args[1] is k8 and args[2] is v8
    assert kwargs["k_scale"] is scales.k and kwargs["v_scale"] is scales.v
    key, value = torch.randn(2, 2, 64, dtype=torch.bfloat16), torch.randn(2, 2, 64, dtype=torch.bfloat16)
    cuda.write_kv(key, value, k8, v8, meta, kv_scales=scales)
    (args, kwargs), = write.calls
    assert args[0] is key and args[1] is value  # quantized from the model's dtype by the kernel, no cast here
    assert kwargs["k_scale"] is scales.k and kwargs["v_scale"] is scales.v
    with pytest.raises(RuntimeError, match="without its scales"):
        cuda.write_kv(key, value, k8, v8, meta)
    # A cache in the model's dtype: no scales anywhere.
    bf16 = torch.zeros(k8.shape, dtype=torch.bfloat16)
    cuda.forward(AttentionInputs(query, None, None, bf16, bf16, meta, params), cuda.plan(meta))
    assert decode.calls[-1][1]["k_scale"] is None and decode.calls[-1][1]["v_scale"] is None


def test_cuda_backend_hands_the_layer_scales_to_prefill_and_extend(monkeypatch):
    query, k8, v8, meta, scales = _fp8_step(q_lens=(4, 7))
    assert meta.phase is Phase.EXTEND
    prefill = _Recorder(torch.zeros_like(query))
    monkeypatch.setattr(cuda_backend, "paged_prefill", prefill)
    cuda = CudaBackend()
    params = AttentionParams(scale=0.125, sliding_window=5, softcap=30.0)
    cuda.forward(AttentionInputs(query, None, None, k8, v8, meta, params, scales), cuda.plan(meta))
    (args, kwargs), = prefill.calls
    assert args[1] is k8 and args[2] is v8
    assert kwargs["k_scale"] is scales.k and kwargs["v_scale"] is scales.v
    assert kwargs["window"] == 5 and kwargs["softcap"] == 30.0
    bf16 = torch.zeros(k8.shape, dtype=torch.bfloat16)
    cuda.forward(AttentionInputs(query, None, None, bf16, bf16, meta, AttentionParams(scale=0.125)), cuda.plan(meta))
    assert prefill.calls[-1][1]["k_scale"] is None and prefill.calls[-1][1]["v_scale"] is None


def test_kernel_entry_points_check_the_scales_before_anything_else():
    query, k8, v8, meta, scales = _fp8_step()
    decode_args = (k8, v8, meta.block_tables, meta.seq_lens_k, 0.125)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        kernels.paged_decode(query, *decode_args)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        kernels.paged_decode(query, *decode_args, k_scale=scales.k)
    bf16 = torch.zeros(k8.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pass None"):
        kernels.paged_decode(query, bf16, bf16, *decode_args[2:], k_scale=scales.k, v_scale=scales.v)
    prefill_args = (k8, v8, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, 0.125)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        paged_prefill(query, *prefill_args, v_scale=scales.v)
    with pytest.raises(ValueError, match="pass None"):
        paged_prefill(query, bf16, bf16, *prefill_args[2:], k_scale=scales.k, v_scale=scales.v)
    key = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        kernels.write_kv(key, key, k8, v8, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="pass None"):
        kernels.write_kv(key, key, bf16, bf16, torch.zeros(2, dtype=torch.long), k_scale=scales.k, v_scale=scales.v)


def test_fp8_head_size_list_matches_the_compiled_switch():
    text = (build.CSRC / "paged_decode_mma_kernel.cuh").read_text()
    body = text[text.index("DecodeKernel select_mma_e4m3_kernel"):]
    body = body[: body.index("default:")]
    assert {int(n) for n in re.findall(r"case (\d+): return make_mma_entry<T, E4M3, \d+>", body)} == set(
        kernels.FP8_HEAD_DIMS)
    assert "paged_decode_e4m3.cu" in build.SOURCES
    assert set(kernels.FP8_HEAD_DIMS) <= set(kernels.HEAD_DIMS)
    # Prefill: one file per query dtype, each compiling exactly FP8_HEAD_DIMS (every config compiled for them).
    for name, dtype in (("f16", "__half"), ("bf16", "__nv_bfloat16")):
        assert f"paged_prefill_{name}_e4m3.cu" in build.SOURCES
        source = (build.CSRC / f"paged_prefill_{name}_e4m3.cu").read_text()
        sizes = re.search(rf"select_head_dim<{dtype}, E4M3, ([\d, ]+)>", source).group(1)
        assert tuple(int(n) for n in sizes.split(",")) == kernels.FP8_HEAD_DIMS, name
