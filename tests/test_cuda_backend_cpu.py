"""The cuda backend without a GPU: it declines with a reason, warns once, and the dispatcher falls back to torch."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hf_paged.attention import AttentionCall, Dispatcher, Phase
from hf_paged.attention.backends.cuda import CudaBackend
from hf_paged.kernels import build

DECODE_CPU = AttentionCall(Phase.DECODE, "cpu", torch.bfloat16, 128, 32, 8, 16)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch):
    """Make the kernels unbuildable here, whatever this machine has, and forget earlier attempts."""
    monkeypatch.setattr(build, "missing_requirement", lambda: "no CUDA GPU is visible")
    monkeypatch.setattr(build, "_loaded", False)
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    build._reset_for_tests()
    yield
    build._reset_for_tests()


def test_declines_cpu_tensors_with_a_reason(no_gpu):
    backend = CudaBackend()
    assert "not a CUDA device" in backend.unsupported_reason(DECODE_CPU)
    assert "not a CUDA device" in backend.write_unsupported_reason("cpu", torch.bfloat16, 128)


@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.EXTEND])
def test_prefill_and_extend_need_the_kernels_half_precision_and_head_dim(no_gpu, phase: Phase):
    call = AttentionCall(phase, "cuda", torch.bfloat16, 128, 32, 8, 16)
    assert "no CUDA GPU" in CudaBackend().unsupported_reason(call)
    assert "bfloat16" in CudaBackend().unsupported_reason(dataclasses.replace(call, dtype=torch.float32))
    assert "head_dim" in CudaBackend().unsupported_reason(dataclasses.replace(call, head_dim=256))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"sliding_window": 64}, "sliding-window"),
        ({"softcap": 30.0}, "softcap"),
        ({"head_dim": 96}, "head_dim"),
        ({"dtype": torch.float64}, "dtype"),
    ],
)
def test_declines_what_the_kernel_lacks(no_gpu, change: dict, words: str):
    fields = dict(phase=Phase.DECODE, device_type="cuda", dtype=torch.float16, head_dim=128, num_heads=32,
                  num_kv_heads=8, block_size=16)
    fields.update(change)
    assert words in CudaBackend().unsupported_reason(AttentionCall(**fields))


def test_dispatcher_picks_torch_on_cpu(no_gpu):
    dispatcher = Dispatcher()
    assert dispatcher.select(DECODE_CPU).name == "torch"
    assert dispatcher.writer(torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)).name == "torch"


def test_without_a_gpu_cuda_calls_fall_back_with_one_warning(no_gpu, caplog: pytest.LogCaptureFixture):
    call = AttentionCall(Phase.DECODE, "cuda", torch.float16, 128, 32, 8, 16)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        first = CudaBackend().unsupported_reason(call)
        second = CudaBackend().write_unsupported_reason("cuda", torch.float16, 128)
        assert Dispatcher().select(call).name != "cuda"
    assert "no CUDA GPU" in first and "no CUDA GPU" in second
    warnings = [r for r in caplog.records if "kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1


def test_kernel_entry_points_raise_the_reason(no_gpu):
    from hf_paged import kernels

    with pytest.raises(kernels.KernelsUnavailable, match="no CUDA GPU"):
        kernels.prebuild(verbose=False)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.paged_decode(torch.zeros(1, 32, 128), torch.zeros(1, 16, 8, 128), torch.zeros(1, 16, 8, 128),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1)
