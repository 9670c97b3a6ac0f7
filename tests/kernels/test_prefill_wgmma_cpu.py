"""The Hopper prefill (``impl="wgmma"``) without a GPU: its build target and sources, the refusals that need no
device, the cuda backend's routing (on Hopper the wgmma form the per-head-size table names, where it serves the
layer), and its benchmark row. The kernel itself is tested on a compute capability 9.0 GPU by
tests/gpu/kernels/test_prefill_wgmma_gpu.py."""

from __future__ import annotations

import re
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from hf_paged.attention import AttentionInputs, AttentionParams, Phase
from hf_paged.attention.backends import _cuda as cuda_backend
from hf_paged.bench import _prefill as prefill_bench
from hf_paged.kernels import _build as build
from hf_paged.kernels._prefill import IMPLS, WGMMA_CONFIGS, WGMMA_HEAD_DIMS, paged_prefill, wgmma_unsupported_reason


@pytest.mark.parametrize(("capability", "arch"), [((9, 0), "90a"), ((8, 0), "80"), ((8, 9), "89"), ((10, 0), "100"),
                                                  ((12, 0), "120")])
def test_hopper_builds_for_its_arch_specific_target(capability: tuple[int, int], arch: str):
    """wgmma needs sm_90a; only 9.0 devices get it (and the define that compiles the kernel), in the -gencode form."""
    assert build.arch_of(*capability) == arch
    flags = build._cuda_flags(arch)
    assert f"-gencode=arch=compute_{arch},code=sm_{arch}" in flags
    assert ("-DHF_PAGED_SM90A" in flags) == (arch == "90a")
    assert not any(f.startswith("-arch") for f in flags)


def test_toolkits_before_cuda_12_build_hopper_for_plain_sm_90():
    assert build.arch_of(9, 0, cuda="11.8") == "90"
    assert build.arch_of(9, 0, cuda="13.0") == "90a"


def test_sources_include_the_wgmma_files_guarded_by_the_define():
    """Both dtypes' files are built everywhere; without HF_PAGED_SM90A they include no wgmma code (stubs)."""
    sources = set(build.SOURCES)
    assert {"paged_prefill_wgmma_f16.cu", "paged_prefill_wgmma_bf16.cu"} <= sources
    assert all((build.CSRC / name).exists() for name in build.SOURCES)
    for dtype in ("f16", "bf16"):
        text = (build.CSRC / f"paged_prefill_wgmma_{dtype}.cu").read_text()
        guarded = text.split("#ifdef HF_PAGED_SM90A", 1)[1]
        assert '#include "paged_prefill_wgmma.cuh"' in guarded.split("#endif", 1)[0]
        sizes = re.search(r"select_head_dim<\w+, ([\d, ]+)>\(head_dim, pipelined\)", text).group(1)
        assert tuple(int(n) for n in sizes.split(",")) == WGMMA_HEAD_DIMS


def test_op_configs_match_the_header():
    header = (build.CSRC / "paged_prefill.cuh").read_text()
    assert f"constexpr int kPrefillConfigWgmma = {WGMMA_CONFIGS['wgmma']};" in header
    assert f"constexpr int kPrefillConfigWgmmaSerial = {WGMMA_CONFIGS['wgmma-serial']};" in header
    assert IMPLS == ("mma", "wgmma", "wgmma-serial")


def _args(dtype=torch.bfloat16, head_dim=128, kv_dtype=None):
    query = torch.zeros(4, 8, head_dim, dtype=dtype)
    cache = torch.zeros(2, 16, 2, head_dim, dtype=kv_dtype or dtype)
    lens = torch.tensor([4], dtype=torch.int32)
    return query, cache, cache, torch.tensor([0, 4], dtype=torch.int32), lens, torch.zeros(1, 1, dtype=torch.int32)


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"impl": "tma"}, ValueError, "impl must be one of"),
    ({"impl": "wgmma", "config": 1}, ValueError, "leave config at -1"),
    ({"impl": "wgmma-serial", "config": 0}, ValueError, "leave config at -1"),
    ({"impl": "wgmma-serial", "head_dim": 48}, NotImplementedError, "not 48"),
    ({"impl": "wgmma", "dtype": torch.float32}, NotImplementedError, "wgmma prefill serves"),
    ({"impl": "wgmma", "head_dim": 72}, NotImplementedError,
     "head_dim (32, 64, 80, 96, 112, 128, 160, 192, 256), not 72"),
    ({"impl": "wgmma", "kv_dtype": torch.float8_e4m3fn}, NotImplementedError, "same dtype"),
])
def test_refusals_before_any_device_work(change: dict, error: type, words: str):
    call = {"impl": "mma", "config": -1, "dtype": torch.bfloat16, "head_dim": 128, "kv_dtype": None} | change
    args = _args(call["dtype"], call["head_dim"], call["kv_dtype"])
    scales = {"k_scale": torch.ones(2), "v_scale": torch.ones(2)} if call["kv_dtype"] is not None else {}
    with pytest.raises(error, match=re.escape(words)):
        paged_prefill(*args, 0.1, max_seqlen_q=4, config=call["config"], impl=call["impl"], **scales)


def test_wgmma_serves_fp16_and_bf16_at_its_head_sizes():
    for dtype in (torch.float16, torch.bfloat16):
        assert all(wgmma_unsupported_reason(dtype, dtype, d) is None for d in WGMMA_HEAD_DIMS)
        assert wgmma_unsupported_reason(dtype, dtype, 72) is not None
        assert wgmma_unsupported_reason(dtype, torch.float8_e4m3fn, 128) is not None
    assert wgmma_unsupported_reason(torch.float32, torch.float32, 128) is not None


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The cuda backend's prefill calls, recorded instead of run, on a device taken for a Hopper GPU."""
    calls: list[dict] = []
    monkeypatch.setattr(cuda_backend, "paged_prefill", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cuda_backend, "_device_has_wgmma", lambda device: True)
    return calls


def _prefill(dtype=torch.bfloat16, head_dim=128, kv_dtype=None):
    query, k_cache, v_cache, cu_q, lens, tables = _args(dtype, head_dim, kv_dtype)
    meta = SimpleNamespace(phase=Phase.PREFILL, cu_seqlens_q=cu_q, seq_lens_k=lens, block_tables=tables,
                           max_seqlen_q=4, single_token_prefix=0)
    backend = cuda_backend.CudaBackend()
    backend.forward(AttentionInputs(query, query, query, k_cache, v_cache, meta, AttentionParams(scale=0.1)),
                    backend.plan(meta))


@pytest.mark.parametrize(("shape", "impl"), [
    ({}, "wgmma"), ({"head_dim": 64}, "wgmma-serial"), ({"dtype": torch.float16, "head_dim": 256}, "wgmma"),
    ({"head_dim": 80}, "wgmma"), ({"head_dim": 32}, "wgmma-serial"), ({"head_dim": 96}, "wgmma-serial"),
    ({"dtype": torch.float16, "head_dim": 96}, "wgmma-serial"), ({"head_dim": 112}, "wgmma"),
    ({"head_dim": 160}, "wgmma"), ({"head_dim": 192}, "wgmma"), ({"head_dim": 72}, "mma"),
    ({"dtype": torch.float32}, "mma"), ({"kv_dtype": torch.float8_e4m3fn}, "mma"),
])
def test_backend_routes_hopper_prefill_to_wgmma_where_it_serves(recorded, shape: dict, impl: str):
    """On Hopper the faster kernel for the head size (serial wgmma at 32, 64 and 96, pipelined elsewhere); the layers
    the kernel does not serve (other sizes, float32, fp8 KV) keep mma."""
    _prefill(**shape)
    assert [c["impl"] for c in recorded] == [impl]


def test_the_routing_table_names_a_wgmma_form_for_every_size_the_kernel_serves():
    assert set(cuda_backend._WGMMA_BY_HEAD_DIM) == set(WGMMA_HEAD_DIMS)
    assert set(cuda_backend._WGMMA_BY_HEAD_DIM.values()) == {"wgmma", "wgmma-serial"}


def test_other_gpus_keep_the_mma_kernel(recorded, monkeypatch):
    monkeypatch.setattr(cuda_backend, "_device_has_wgmma", lambda device: False)
    _prefill()
    _prefill(head_dim=64)
    assert [c["impl"] for c in recorded] == ["mma", "mma"]


@pytest.mark.parametrize(("capability", "cuda", "has"), [((9, 0), "13.0", True), ((9, 0), "11.8", False),
                                                         ((8, 0), "13.0", False), ((10, 0), "13.0", False)])
def test_wgmma_needs_hopper_and_an_sm_90a_build(monkeypatch, capability, cuda: str, has: bool):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    cuda_backend._has_wgmma.cache_clear()  # (asked once per device)
    try:
        assert cuda_backend._device_has_wgmma(torch.device("cuda", 0)) is has
    finally:
        cuda_backend._has_wgmma.cache_clear()


@pytest.mark.parametrize(("capability", "present"), [((9, 0), True), ((8, 0), False), ((10, 0), False)])
def test_bench_times_the_wgmma_row_on_hopper_only(monkeypatch, capability, present: bool):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    rows = prefill_bench.contenders([], 0, 2048, 128, sweep=False)
    assert ("ours-wgmma-bs16" in rows) == present and ("ours-wgmma-serial-bs16" in rows) == present


def test_prefill_table_shows_wgmma_over_flash(capsys):
    rows = [asdict(prefill_bench.Row(128, "8x2048", impl, 1.0, tflops, "graph", "", 0, 0.0))
            for impl, tflops in [("ours-bs16", 280.0), ("ours-wgmma-bs16", 330.0), ("flash-varlen", 300.0)]]
    prefill_bench.print_table({"device": "GPU", "rows": rows})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "shape" in line)
    columns = [c.strip() for c in header.split("|")]
    row = [c.strip() for c in next(line for line in lines if "8x2048" in line).split("|")]
    assert row[columns.index("ours-wgmma-bs16")] == "330.0"
    assert row[columns.index("wgmma/flash")] == "1.10" and row[columns.index("bs16/flash")] == "0.93"
