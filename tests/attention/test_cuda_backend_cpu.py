"""The cuda backend without a GPU: it declines with a reason, warns once, and the dispatcher falls back to torch."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from hf_paged import kernels
from hf_paged.attention import AttentionCall, AttentionInputs, AttentionParams, Dispatcher, Phase
from hf_paged.attention._metadata import build_metadata
from hf_paged.attention.backends import _cuda as cuda_backend
from hf_paged.attention.backends._cuda import CudaBackend
from hf_paged.kernels import _build as build
from hf_paged.kernels._prefill import PREFILL_CONFIGS, prefill_configs

DECODE_CPU = AttentionCall(Phase.DECODE, "cpu", torch.bfloat16, 128, 32, 8, 16)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch):
    """Make the kernels unbuildable here, whatever this machine has, and forget earlier attempts."""
    monkeypatch.setattr(build, "missing_device", lambda: "no CUDA GPU is visible")
    monkeypatch.setattr(build, "missing_requirement", lambda: "no CUDA GPU is visible")
    for name, fresh in (("_failure", None), ("_warned", False), ("_folder", None)):
        monkeypatch.setattr(build, name, fresh)  # (put back after the test)
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)


def test_declines_cpu_tensors_with_a_reason(no_gpu):
    backend = CudaBackend()
    assert "not a CUDA device" in backend.unsupported_reason(DECODE_CPU)
    assert "not a CUDA device" in backend.write_unsupported_reason("cpu", torch.bfloat16, 128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL, Phase.EXTEND])
def test_every_compiled_head_size_passes_to_the_kernels(no_gpu, phase: Phase, dtype: torch.dtype):
    """Each phase, dtype and head size of issue 11's list gets past the shape checks: only the missing GPU refuses."""
    assert kernels.HEAD_DIMS == (32, 64, 80, 96, 112, 128, 160, 192, 256)
    for head_dim in kernels.HEAD_DIMS:
        call = AttentionCall(phase, "cuda", dtype, head_dim, 32, 8, 16)
        assert "no CUDA GPU" in CudaBackend().unsupported_reason(call), (phase, dtype, head_dim)


@pytest.mark.parametrize("head_dim", [8, 16, 40, 48, 72, 120, 136, 224, 320])
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_head_sizes_not_compiled_are_refused_by_name(no_gpu, phase: Phase, head_dim: int):
    reason = CudaBackend().unsupported_reason(AttentionCall(phase, "cuda", torch.bfloat16, head_dim, 32, 8, 16))
    assert f"head_dim {head_dim} is not compiled (32, 64, 80, 96, 112, 128, 160, 192, 256 are)" == reason
    assert "is not compiled" in CudaBackend().write_unsupported_reason("cuda", torch.bfloat16, head_dim)


def _compiled_cases(*names: str) -> set[int]:
    """Head sizes the kernel selection of these csrc files compiles: `case N:` labels of the decode switches, the
    template arguments of prefill's select_head_dim<T, KV, N...>."""
    text = "".join((build.CSRC / name).read_text() for name in names)
    sizes = {int(n) for n in re.findall(r"case (\d+): return (?:make_mma_entry|select_group_tile)", text)}
    for args in re.findall(r"select_head_dim<\w+, \w+, ([\d, ]+)>", text):
        sizes |= {int(n) for n in args.split(",")}
    return sizes


def test_head_size_list_matches_the_compiled_switches():
    """kernels.HEAD_DIMS (what the backend accepts) is exactly what each kernel family compiles."""
    assert _compiled_cases("paged_decode_mma_kernel.cuh") == set(kernels.HEAD_DIMS)
    assert _compiled_cases("paged_decode_simt_kernel.cuh") == set(kernels.HEAD_DIMS)
    for dtype in ("f16", "bf16"):
        assert _compiled_cases(f"paged_prefill_{dtype}.cu", f"paged_prefill_{dtype}_wide.cu") == set(kernels.HEAD_DIMS)
    sources = set(build.SOURCES)
    assert {"paged_prefill_f16_wide.cu", "paged_prefill_bf16_wide.cu"} <= sources


def test_prefill_configs_per_head_size():
    """Config 0 (32 rows per warp) is compiled up to head_dim 128 only; paged_prefill refuses it above, by name."""
    assert all(prefill_configs(d) == PREFILL_CONFIGS for d in kernels.HEAD_DIMS if d <= 128)
    assert all(prefill_configs(d) == (1, 2) for d in kernels.HEAD_DIMS if d > 128)


@pytest.mark.parametrize(("change", "words"), [({"head_dim": 120}, "head_dim"), ({"dtype": torch.float64}, "dtype")])
def test_declines_what_the_kernel_lacks(no_gpu, change: dict, words: str):
    fields = dict(phase=Phase.DECODE, device_type="cuda", dtype=torch.float16, head_dim=128, num_heads=32,
                  num_kv_heads=8, block_size=16)
    fields.update(change)
    assert words in CudaBackend().unsupported_reason(AttentionCall(**fields))


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL, Phase.EXTEND])
@pytest.mark.parametrize("extras", [{"sliding_window": 64}, {"softcap": 30.0},
                                    {"sliding_window": 4096, "softcap": 50.0}], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_sliding_window_and_softcap_go_to_the_kernels(no_gpu, monkeypatch, phase: Phase, extras: dict,
                                                      block_size: int):
    """Mistral, Gemma2/3 and windowed Qwen2 layers at any block size: the kernels take both as arguments, so the
    backend refuses them only when the kernels cannot load, and serves them (in dispatch order) when they can."""
    call = AttentionCall(phase, "cuda", torch.bfloat16, 128, 32, 8, block_size, **extras)
    assert "no CUDA GPU" in CudaBackend().unsupported_reason(call)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: None)
    assert CudaBackend().unsupported_reason(call) is None
    assert Dispatcher(backend=("cuda", "torch")).select(call).name == "cuda"


def test_window_shortens_the_decode_workspace():
    """A windowed decode's splits cover min(max_seq_len, window) keys: its workspace (sized on the host, fixed under a
    CUDA graph) shrinks with the window and equals the unwindowed one when the window is longer than the context."""
    assert kernels.decode_keys(8192, 0) == 8192 and kernels.decode_keys(8192, 4096) == 4096
    assert kernels.decode_keys(100, 4096) == 100
    full = kernels.decode_workspace_numel(4, 32, 128, 8192, 512)
    assert full == 4 * 32 * 16 * 130
    assert kernels.decode_workspace_numel(4, 32, 128, 8192, 512, window=1000) == 4 * 32 * 2 * 130
    assert kernels.decode_workspace_numel(4, 32, 128, 8192, 512, window=512) == 0  # one split: no partials
    assert kernels.decode_workspace_numel(4, 32, 128, 8192, 512, window=10**6) == full


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
    with pytest.raises(kernels.KernelsUnavailable, match="no CUDA GPU"):
        kernels.prebuild(verbose=False)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.paged_decode(torch.zeros(1, 32, 128), torch.zeros(1, 16, 8, 128), torch.zeros(1, 16, 8, 128),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1)


def _mixed_step(monkeypatch, dtype: torch.dtype):
    """A mixed step of a decode, a decode, a prompt chunk and a one-token row behind it (``single_token_prefix``
    2), run through two layers of the cuda backend with its kernels recorded, not run: (decode calls, prefill calls,
    the last output, query, metadata, context lengths)."""
    decode, prefill = [], []
    monkeypatch.setattr(cuda_backend, "plan_decode", lambda *a: cuda_backend.DecodePlan(64, None))
    monkeypatch.setattr(cuda_backend.kernels, "paged_decode", lambda *a, **k: decode.append((a, k)))
    monkeypatch.setattr(cuda_backend, "paged_prefill", lambda *a, **k: prefill.append((a, k)) or k["out"])
    monkeypatch.setattr(cuda_backend, "prefill_impl", lambda *a: "mma")
    gen = torch.Generator().manual_seed(6)
    q_lens, lens = [1, 1, 5, 1], [9, 30, 5, 12]  # decode, decode, a prompt chunk, a one-token row behind it
    meta = build_metadata(q_lens=torch.tensor(q_lens), seq_lens_k=torch.tensor(lens),
                          block_tables=torch.randint(0, 50, (4, 8), generator=gen), slot_mapping=torch.arange(8),
                          token_index=None, grid=(1, 8), block_size=4, device=torch.device("cpu"))
    meta = dataclasses.replace(meta, single_token_prefix=2)
    query, cache = torch.randn(8, 4, 32, generator=gen).to(dtype), torch.zeros(50, 4, 2, 32, dtype=dtype)
    backend, params = cuda_backend.CudaBackend(), AttentionParams(scale=0.1)
    plan = backend.plan(meta)  # once per step
    for _ in range(2):  # two layers of one step
        out = backend.forward(AttentionInputs(query, query, query, cache, cache, meta, params), plan)
    return decode, prefill, out, query, meta, lens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_mixed_step_sends_its_leading_decode_rows_to_the_decode_kernel(monkeypatch, dtype: torch.dtype):
    """The routing alone (tests/gpu/attention/test_mixed_step_gpu.py judges the numbers): the first
    ``single_token_prefix`` rows to the decode kernel, the chunks to the prefill kernel with the tail of
    ``cu_seqlens_q``, both into one output, the step's cut made once for every layer."""
    decode, prefill, out, query, meta, lens = _mixed_step(monkeypatch, dtype)
    (d_args, d_kwargs), (p_args, p_kwargs) = decode[-1], prefill[-1]
    assert torch.equal(d_args[0], query[:2]) and torch.equal(d_args[3], meta.block_tables[:2])
    assert d_args[4].tolist() == lens[:2] and d_kwargs["out"].data_ptr() == out.data_ptr()
    assert d_kwargs["out"].shape == (2, 4, 32)
    assert p_args[0] is query and p_kwargs["out"] is out
    assert p_args[3].tolist() == [2, 7, 8] and p_args[4].tolist() == lens[2:]  # cu q offsets index the whole query
    assert torch.equal(p_args[5], meta.block_tables[2:])
    assert decode[0][0][3] is decode[1][0][3] and prefill[0][0][3] is prefill[1][0][3]  # cut once per step


def test_a_float32_mixed_step_goes_to_the_prefill_path_whole(monkeypatch):
    """float32's prefill runs every query row as a decode of a sequence of its ``cu_seqlens_q``: handed the tail of
    a split step, it overwrote the decode rows the decode kernel had written (a GPU engine in float32 then gave
    other tokens once its schedule changed). So float32 takes no split: one prefill call over the whole step."""
    decode, prefill, out, query, meta, lens = _mixed_step(monkeypatch, torch.float32)
    assert decode == [] and len(prefill) == 2
    p_args, p_kwargs = prefill[-1]
    assert p_args[0] is query and p_args[3].tolist() == [0, 1, 2, 7, 8] and p_args[4].tolist() == lens
    assert torch.equal(p_args[5], meta.block_tables) and p_kwargs["out"] is None
