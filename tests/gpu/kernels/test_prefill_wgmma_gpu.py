"""The Hopper prefill kernels (``paged_prefill(..., impl="wgmma")`` and ``impl="wgmma-serial"``,
``csrc/paged_prefill_wgmma*.cuh``) against the float64 torch oracle, on a compute capability 9.0 GPU (skipped
elsewhere).

The grid of test_cuda_prefill.py and test_kernel_rows_prefill.py for the kernel's head sizes (32 to 256, multiples
of 16, as compiled): prompt lengths crossing its 128-row query tiles and 128-key (64 above head_dim 128) key tiles,
block sizes 16 and 48 (not a power of two; 256 for the exact rows), GQA, MHA and MQA, extends after paged prefixes,
long runs, sliding windows and softcaps; outputs NaN-poisoned first, judged over the batch and row by row, and on
inputs with exact answers. Then: the same inputs twice give identical bits (a race moves them), a CUDA-graph replay
equals the eager call, and the cuda backend routes prefill here (the form its per-head-size table names).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from kernel_oracle import assert_rows_close, sparse_allowance
from kernel_rows import check_prefill_rows
from kernel_steps import ROW_TOLERANCE, check, prefill_step, reference

from hf_paged.attention import AttentionInputs, AttentionParams
from hf_paged.attention.backends.base import backend_named
from hf_paged.attention.backends._cuda import _WGMMA_BY_HEAD_DIM
from hf_paged.kernels._prefill import WGMMA_CONFIGS, WGMMA_HEAD_DIMS, paged_prefill

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the wgmma prefill runs on compute capability 9.0 (Hopper) only", allow_module_level=True)

HEADS = {"gqa-32/8": (32, 8), "mha-16/16": (16, 16), "mqa-8/1": (8, 1)}
# (cached prefix lengths, new-token counts): query tiles of 128 rows, key tiles of 128 (64 at head_dim 256), full and
# ragged, prefixes ending on and around tile and block edges.
SCENARIOS = {
    "one-token": ([0], [1]),
    "tile-edges": ([0, 0, 0, 0, 0, 0, 0], [1, 63, 64, 127, 128, 129, 300]),
    "extend-mixed": ([0, 5, 1000, 47, 3995], [1, 1, 33, 200, 5]),
    "prefix-edges": ([63, 64, 127, 128, 129, 255, 256, 257], [129, 128, 127, 1, 64, 65, 200, 256]),
    "long-prefix": ([3000, 0], [700, 1]),
}
LONG = {"prefill-4096": ([0], [4096]), "prefix-2048": ([2048, 2500], [2048, 1000])}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Every compiled size, or the comma list in HF_PAGED_TEST_WGMMA_DIMS (a GPU session re-checking only some sizes);
# a size that is not compiled is an error, not a silent skip.
HEAD_DIMS = tuple(int(d) for d in os.environ.get("HF_PAGED_TEST_WGMMA_DIMS", "").split(",") if d) or WGMMA_HEAD_DIMS
if not set(HEAD_DIMS) <= set(WGMMA_HEAD_DIMS):
    raise ValueError(f"HF_PAGED_TEST_WGMMA_DIMS={HEAD_DIMS} names sizes the wgmma kernels do not serve "
                     f"({WGMMA_HEAD_DIMS})")
IMPLS = tuple(WGMMA_CONFIGS)  # the pipelined kernel and its serial form


def run_wgmma(query, k_cache, v_cache, meta, params, window: int = 0, softcap: float = 0.0,
              impl: str = "wgmma") -> torch.Tensor:
    out = torch.full_like(query, float("nan"))  # every element must be written
    return paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables,
                         params.scale, max_seqlen_q=meta.max_seqlen_q, out=out, window=window, softcap=softcap,
                         impl=impl)


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_wgmma_matches_float64_reference(scenario, block_size, heads, head_dim, dtype):
    step = prefill_step(*SCENARIOS[scenario], block_size, *heads, head_dim, dtype,
                        seeded(scenario, block_size, heads, head_dim, dtype))
    meta, query, _, _, k_cache, v_cache, params = step
    expected = reference(query, k_cache, v_cache, meta, params)
    for impl in IMPLS:
        check(run_wgmma(query, k_cache, v_cache, meta, params, impl=impl), expected, dtype, f"{impl} {scenario}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("scenario", LONG)
def test_wgmma_long_sequences(scenario, block_size, head_dim):
    """4096 new tokens in one run, 2048 after a 2048-token prefix (MQA keeps the oracle small)."""
    meta, query, _, _, k_cache, v_cache, params = prefill_step(*LONG[scenario], block_size, 8, 1, head_dim,
                                                               torch.bfloat16, seeded(scenario, block_size, head_dim))
    expected = reference(query, k_cache, v_cache, meta, params)
    for impl in IMPLS:
        check(run_wgmma(query, k_cache, v_cache, meta, params, impl=impl), expected, torch.bfloat16,
              f"{impl} {scenario}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)],
                         ids=["bf16-d128", "fp16-d64", "bf16-d256"])
@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_wgmma_rows_are_exact_means(block_size: int, dtype: torch.dtype, head_dim: int, heads, impl: str):
    """Zero keys, position-coded values: one key dropped or read twice at a tile or block edge fails its row."""
    check_prefill_rows(heads, dtype, head_dim, block_size, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_wgmma_rows_with_windows_and_softcap(head_dim: int, impl: str):
    """Windows shorter than a block, inside a tile, across tiles and longer than every context; a softcap on top."""
    check_prefill_rows((8, 2), torch.bfloat16, head_dim, 16, windows=(1, 5, 100, 700, 100_000), softcap=30.0,
                       impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window, softcap", [(0, 5.0), (20, 0.0), (200, 30.0)])
def test_wgmma_window_and_softcap_on_random_inputs(window: int, softcap: float, head_dim: int, impl: str):
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 30, 300], [1, 140, 260], 16, 16, 4, head_dim,
                                                               torch.bfloat16, seeded(window, softcap, head_dim))
    options = AttentionParams(scale=params.scale, sliding_window=window or None, softcap=softcap or None)
    check(run_wgmma(query, k_cache, v_cache, meta, params, window, softcap, impl),
          reference(query, k_cache, v_cache, meta, options), torch.bfloat16, f"{impl} window {window} cap {softcap}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_wgmma_reads_probabilities_through_one_hot_values(head_dim: int, impl: str):
    """A diagnostic pair for test_wgmma_rows_are_exact_means (zero keys: only P V matters there): here the value of
    key j is one-hot at dimension j mod head_dim, so each output row is its attention probabilities folded by key
    position, S = Q K^T read out through a P V that only moves them. This failing alone points at Q K^T (the Q / K
    descriptors); the exact means failing alone at P V (the V descriptor)."""
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 200], [300, 57], 16, 8, 1, head_dim,
                                                               torch.bfloat16, seeded("one-hot", head_dim))
    flat_v = v_cache.view(-1, 1, head_dim)
    for b, total in enumerate(meta.seq_lens_k.tolist()):
        pos = torch.arange(total, device=v_cache.device)
        slots = meta.block_tables[b, pos // 16].long() * 16 + pos % 16
        flat_v[slots, 0] = torch.nn.functional.one_hot(pos % head_dim, head_dim).to(v_cache.dtype)
    out, expected = run_wgmma(query, k_cache, v_cache, meta, params, impl=impl), reference(query, k_cache, v_cache,
                                                                                        meta, params)
    assert not out.isnan().any(), f"{impl} one-hot values: NaN left in the output"
    # sparse rows: the rms allowance alone fails a correct kernel's bf16 rounding of P at head_dim 256
    # (tests/kernels/test_kernel_oracle.py shows it on the CPU)
    assert_rows_close(out, expected, sparse_allowance(expected, torch.bfloat16, ROW_TOLERANCE[torch.bfloat16]),
                      f"{impl} one-hot values")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_wgmma_is_deterministic_and_close_to_mma(head_dim: int, impl: str):
    """The same inputs twice give the same bits (a missing barrier or fence shows as a moving answer), and the
    answer is within bf16 rounding of the mma.sync kernel's."""
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 70, 0, 999], [130, 1, 63, 257], 16, 32, 8,
                                                               head_dim, torch.bfloat16, seeded("twice", head_dim))
    first = run_wgmma(query, k_cache, v_cache, meta, params, impl=impl)
    for _ in range(3):
        assert torch.equal(run_wgmma(query, k_cache, v_cache, meta, params, impl=impl), first), "the answer moved"
    mma = paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, params.scale,
                        max_seqlen_q=meta.max_seqlen_q)
    rel = ((first.double() - mma.double()).norm() / mma.double().norm()).item()
    assert rel < 1e-2, f"{impl} and mma prefill differ by {rel:.2e}"


@pytest.mark.parametrize("impl", IMPLS)
def test_wgmma_replays_in_a_cuda_graph(impl: str):
    """Capture-safe: no allocation or host decision per call; a replay over new query values equals the eager call."""
    meta, query, _, _, k_cache, v_cache, params = prefill_step([0, 100], [200, 77], 16, 32, 8, 128, torch.bfloat16,
                                                               seeded("graph"))
    out = torch.empty_like(query)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_wgmma(query, k_cache, v_cache, meta, params, impl=impl)  # warm-up: builds, sets the shared-memory limit
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, params.scale,
                      max_seqlen_q=meta.max_seqlen_q, out=out, impl=impl)
    query.copy_(torch.randn(query.shape, generator=seeded("graph", 2)).to(query))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run_wgmma(query, k_cache, v_cache, meta, params, impl=impl))


def test_cuda_backend_routes_prefill_here():
    """The cuda backend's prefill is, bit for bit, the answer of the kernel the routing table names for each head
    size (pipelined wgmma at 128, serial at 32, 64 and 96, ...), and within the oracle's bounds."""
    backend = backend_named("cuda")
    defaults = {**{d: "mma" for d in WGMMA_HEAD_DIMS}, **_WGMMA_BY_HEAD_DIM}
    assert defaults[128] == "wgmma" and defaults[32] == defaults[64] == defaults[96] == "wgmma-serial"
    for head_dim, default in ((d, defaults[d]) for d in HEAD_DIMS):
        meta, query, key, value, k_cache, v_cache, params = prefill_step([0, 40, 300], [9, 1, 120], 16, 32, 8,
                                                                         head_dim, torch.bfloat16, seeded("env"))
        out = backend.forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params), backend.plan(meta))
        assert torch.equal(out, run_wgmma(query, k_cache, v_cache, meta, params, impl=default))
        check(out, reference(query, k_cache, v_cache, meta, params), torch.bfloat16, f"backend {default}")
