"""On the GPU: the wide skinny kernel (hf_paged/csrc/skinny_gemm_wide.cu, 9 to 64 rows of x) against a float64
oracle, in CUDA graphs, behind ``skinny.linear`` with ``HF_PAGED_SKINNY_WIDE=1``, and in a model's greedy decode
(under inductor: test_skinny_linear_gpu.py's compiled MLP, with the switch on).

Rows M from 9 to 64, each count of n-tiles of 8 (2 to 8), whole and partial; weights [N, K] with N not a multiple
of 16 and K from 64 to 14336 chosen for every split of K on an H100 (132 SMs): a few tiles with K split over clusters
of 8 blocks and over 8 warps, clusters of 8 and 2 warps, clusters of 4, 2 and none, K with a partial chunk (2056),
a partial slice (264) and one slice (64); groups of 2 to 4 weights (Llama-3.1-8B's q+k+v and gate+up on one GPU
and on a tensor-parallel rank of two, and an odd one); fp16 and bf16, with and without bias. Every output row is
judged on its own (a wrong or dropped row fails), as in test_skinny_linear_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hf_paged import kernels  # noqa: E402
from hf_paged.compile import _skinny_linears as skinny_linear  # noqa: E402
from hf_paged.kernels import _skinny as skinny  # noqa: E402

from test_end_to_end_gpu import NEW_TOKENS  # noqa: E402  (same folder)
from test_skinny_linear_gpu import (  # noqa: E402
    ACCUMULATION, DEVICE, ROUNDING, assert_greedy_matches, assert_rows_close, greedy_batch, oracle, random_linear,
    tiny_llama)

if kernels.unavailable_reason() is not None:
    pytest.skip(f"hf_paged kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)

ROWS = (9, 16, 17, 25, 33, 41, 56, 64)
# (N, K) and the split of K on an H100 (clusters x warps): 3 tiles (8 x 8), 63 tiles (8 x 2), 513 tiles (4 x 1),
# 1793 tiles (none), a partial chunk (8 x 2), a partial slice (2 x 2), one slice (none)
SHAPES = [(40, 4096), (1000, 14336), (8200, 4096), (28680, 2056), (1000, 2056), (200, 264), (520, 64)]
GROUPS = {"8b-qkv": ((4096, 1024, 1024), 4096), "8b-gate-up": ((14336, 14336), 4096),
          "8b-tp2-qkv": ((2048, 512, 512), 4096), "8b-tp2-gate-up": ((7168, 7168), 4096),
          "odd-four": ((1000, 40, 8, 520), 2056)}


@pytest.fixture(autouse=True)
def wide_on(monkeypatch):
    monkeypatch.setenv(skinny.WIDE_ENV, "1")
    monkeypatch.setattr(skinny, "CUBLAS_BELOW_BYTES", 0)  # the kernel at every shape here


def allowed(x: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return ROUNDING[x.dtype] * want.abs() + ACCUMULATION * scale + 1e-6


def assert_close_to_oracle(x, out, weight, bias, label: str) -> None:
    want, scale = oracle(x, weight, bias)
    assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype and out.is_contiguous(), label
    assert_rows_close(out, want, allowed(x, want, scale), label)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_rows_match_float64(n, k, dtype, with_bias):
    gen = torch.Generator(DEVICE).manual_seed(n * 31 + k + with_bias)
    weight, bias = random_linear(n, k, dtype, with_bias, gen)
    for m in ROWS:
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
        assert skinny.kernel_serves(x, weight, bias)
        got = torch.ops.hf_paged.skinny_gemm_wide(x, weight, bias)
        assert_close_to_oracle(x, got, weight, bias, f"M={m} N={n} K={k} {dtype} bias={with_bias}")
        assert torch.equal(skinny.linear(x, weight, bias), got), "skinny.linear should launch the wide kernel"


def test_strided_rows_and_leading_dims_are_served():
    gen = torch.Generator(DEVICE).manual_seed(3)
    weight, bias = random_linear(1000, 2048, torch.bfloat16, True, gen)
    hidden = torch.randn(40, 3, 2048, device=DEVICE, generator=gen).to(torch.bfloat16)
    for x in (hidden[:, -1, :], hidden[:20]):  # 40 rows 3 * 2048 apart; [20, 3, K]: 60 rows
        assert skinny.kernel_serves(x, weight, bias)
        got = skinny.linear(x, weight, bias)
        assert got.shape == (*x.shape[:-1], 1000) and got.is_contiguous()
        rows = x.reshape(-1, 2048)
        assert_close_to_oracle(rows, got.reshape(-1, 1000), weight, bias, f"x {tuple(x.shape)} strides {x.stride()}")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_group_rows_match_float64(group, dtype, with_bias):
    assert_group_rows_match(torch.ops.hf_paged.skinny_gemm_wide_group, group, dtype, with_bias, ROWS)


def assert_group_rows_match(op, group: str, dtype: torch.dtype, with_bias: bool, rows) -> None:
    """``op`` (a grouped skinny op) on the group's fresh random weights against float64, per output row, at each of
    ``rows``; above MAX_ROWS, ``skinny.linear_group`` launches the same op (the switch the caller set)."""
    gen = torch.Generator(DEVICE).manual_seed(len(group) * 13 + with_bias)
    weights, biases = random_group(group, dtype, with_bias, gen)
    for m in rows:
        x = torch.randn(m, GROUPS[group][1], device=DEVICE, generator=gen).to(dtype)
        outs = op(x, weights, biases)
        assert len(outs) == len(weights)
        for i, (out, weight, bias) in enumerate(zip(outs, weights, biases, strict=True)):
            assert_close_to_oracle(x, out, weight, bias, f"{group} M={m} {dtype} bias={with_bias} weight {i}")
        if m > skinny.MAX_ROWS:
            served = skinny.linear_group(x, weights, biases)
            assert all(torch.equal(a, b) for a, b in zip(served, outs, strict=True)), "linear_group should launch it"


def random_group(group: str, dtype: torch.dtype, with_bias: bool, gen: torch.Generator):
    """The group's weights and biases (the second weight never has a bias: groups mix both)."""
    widths, k = GROUPS[group]
    pairs = [random_linear(n, k, dtype, with_bias and i != 1, gen) for i, n in enumerate(widths)]
    return [w for w, _ in pairs], [b for _, b in pairs]


def fresh_weights(group: str | None, gen: torch.Generator):
    """The group's weights and biases in bf16 with biases; one 1000 x 2056 weight where group is None."""
    if group is None:
        weight, bias = random_linear(1000, 2056, torch.bfloat16, True, gen)
        return [weight], [bias]
    return random_group(group, torch.bfloat16, True, gen)


@pytest.mark.parametrize("group", ["8b-tp2-qkv", "odd-four", None], ids=["tp2-qkv", "odd-four", "single-1000x2056"])
def test_graph_replay_with_new_data(group):
    assert_graph_replays_with_new_data(group)


def assert_graph_replays_with_new_data(group: str | None) -> None:
    """The routed call (skinny.linear, or linear_group for a group) at 48 rows, captured once: it allocates only its
    outputs, and three replays over fresh weights and x match float64."""
    gen = torch.Generator(DEVICE).manual_seed(7)
    weights, biases = fresh_weights(group, gen)
    x = torch.randn(48, weights[0].shape[1], device=DEVICE, generator=gen).to(torch.bfloat16)

    def call():
        return [skinny.linear(x, weights[0], biases[0])] if group is None else skinny.linear_group(x, weights, biases)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside the capture
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        call()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == len(weights)  # the outputs
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
    for step in range(3):
        new_weights, new_biases = fresh_weights(group, gen)
        for old, new in zip([*weights, *biases], [*new_weights, *new_biases], strict=True):
            if old is not None:
                old.copy_(new)
        x.copy_(torch.randn(x.shape, device=DEVICE, generator=gen))
        graph.replay()
        for i, (out, weight, bias) in enumerate(zip(outs, weights, biases, strict=True)):
            assert_close_to_oracle(x, out, weight, bias, f"{group} replay {step} weight {i}")


def test_without_the_switch_more_than_8_rows_are_f_linear(monkeypatch):
    monkeypatch.delenv(skinny.WIDE_ENV)
    gen = torch.Generator(DEVICE).manual_seed(5)
    weight, bias = random_linear(512, 2048, torch.bfloat16, True, gen)
    x = torch.randn(20, 2048, device=DEVICE, generator=gen).to(torch.bfloat16)
    assert not skinny.kernel_serves(x, weight, bias)
    assert torch.equal(skinny.linear(x, weight, bias), F.linear(x, weight, bias))
    monkeypatch.setenv(skinny.WIDE_ENV, "1")
    assert torch.equal(skinny.linear(x, weight, bias), torch.ops.hf_paged.skinny_gemm_wide(x, weight, bias))


def test_the_ops_refuse_bad_arguments_with_what_to_change():
    w = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(65, 64, device=DEVICE, dtype=torch.bfloat16)
    for rows in (8, 65):
        with pytest.raises(ValueError, match="skinny_gemm_wide serves 9 to 64 rows"):
            torch.ops.hf_paged.skinny_gemm_wide(x[:rows], w, None)
    with pytest.raises(ValueError, match="at most 8 rows"):
        torch.ops.hf_paged.skinny_gemm(x[:9], w, None)
    with pytest.raises(NotImplementedError, match="skinny_gemm_wide serves float16 and bfloat16"):
        torch.ops.hf_paged.skinny_gemm_wide(x[:9].float(), w.float(), None)
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        torch.ops.hf_paged.skinny_gemm_wide(x[:9], w.half(), None)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        torch.ops.hf_paged.skinny_gemm_wide(x[:9], w, torch.zeros(8, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="skinny_gemm_wide_group serves 1 to 4 weights"):
        torch.ops.hf_paged.skinny_gemm_wide_group(x[:9], [w] * 5, [None] * 5)
    with pytest.raises(ValueError, match=r"x must be \[rows, K\]"):
        torch.ops.hf_paged.skinny_gemm_wide_group(x[:9], [w, w[:, :32].contiguous()], [None, None])


def test_greedy_tokens_with_the_wide_kernel_equal_those_without(monkeypatch):
    assert_greedy_tokens_through(monkeypatch, "skinny_gemm_wide", "wide")


def assert_greedy_tokens_through(monkeypatch, op_name: str, kernel: str) -> None:
    """A tiny model's greedy tokens with the op serving 20 decode rows equal those without, and every decode step
    of every patched linear ran the op (counted through a wrapper)."""
    model = tiny_llama()
    lengths = [1, 15, 17, 100, 300, 7, 33, 64, 2, 90, 5, 40, 11, 128, 3, 21, 60, 9, 70, 12]  # 20 decode rows
    calls = []
    op = getattr(torch.ops.hf_paged, op_name)
    monkeypatch.setattr(torch.ops.hf_paged, op_name, lambda *a: calls.append(1) or op(*a))
    assert_greedy_matches(model, greedy_batch(lengths, seed=2), f"{kernel} skinny")
    patched = skinny_linear.install(model)
    assert len(calls) >= len(patched) * (NEW_TOKENS - 1), f"the decode steps should run the {kernel} kernel"
