"""On a Hopper GPU: the wgmma skinny kernel (hf_paged/csrc/skinny_gemm_wgmma.cu, 1 to 64 rows of x) against a float64
oracle, in CUDA graphs, behind ``skinny.linear`` with ``HF_PAGED_SKINNY_WIDE=wgmma``, and in a model's greedy decode.

Rows M from 1 to 64, both sizes of x's tile (32 and 64 rows), whole and partial; weights [N, K] with N not a
multiple of the 128-row tile and K chosen for every split of K on an H100 (132 SMs, two blocks an SM): one tile with
K split over a cluster of 8, tiles split over 8, 4 and 2, none, K with a partial 64-wide step (2056, 264, 8) and one
step (64); groups of 2 to 4 weights (Llama-3.1-8B's q+k+v and gate+up on one GPU and on a tensor-parallel rank of
two, and an odd one); fp16 and bf16, with and without bias. Every output row is judged on its own (a wrong or
dropped row fails), as in test_skinny_linear_gpu.py. Off Hopper, the op's refusal.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hf_paged import kernels  # noqa: E402
from hf_paged.kernels import _skinny as skinny  # noqa: E402

from test_skinny_linear_gpu import DEVICE, random_linear  # noqa: E402  (same folder)
from test_skinny_wide_gpu import (  # noqa: E402  (the same shapes, oracle and checks)
    GROUPS, assert_close_to_oracle, assert_graph_replays_with_new_data, assert_greedy_tokens_through,
    assert_group_rows_match, random_group)

if kernels.unavailable_reason() is not None:
    pytest.skip(f"hf_paged kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)

HOPPER = torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="the wgmma kernel runs on compute capability 9.0 only")

ROWS = (1, 8, 9, 16, 31, 32, 33, 40, 57, 64)
# (N, K): 1 tile (cluster 8), 8 tiles (8), 65 tiles (2), 225 tiles (none), a partial step (8), a partial step with
# 5 steps (2), one step (none), K of one partial step
SHAPES = [(40, 4096), (1000, 14336), (8200, 4096), (28680, 2056), (1000, 2056), (200, 264), (520, 64), (130, 8)]


@pytest.fixture(autouse=True)
def wgmma_on(monkeypatch):
    monkeypatch.setenv(skinny.WIDE_ENV, "wgmma")
    monkeypatch.setattr(skinny, "CUBLAS_BELOW_BYTES", 0)  # the kernel at every shape here


@hopper_only
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_rows_match_float64(n, k, dtype, with_bias):
    gen = torch.Generator(DEVICE).manual_seed(n * 31 + k + with_bias)
    weight, bias = random_linear(n, k, dtype, with_bias, gen)
    for m in ROWS:
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
        got = torch.ops.hf_paged.skinny_gemm_wgmma(x, weight, bias)
        assert_close_to_oracle(x, got, weight, bias, f"M={m} N={n} K={k} {dtype} bias={with_bias}")
        if m > skinny.MAX_ROWS:
            assert torch.equal(skinny.linear(x, weight, bias), got), "skinny.linear should launch the wgmma kernel"


@hopper_only
def test_strided_rows_are_served():
    gen = torch.Generator(DEVICE).manual_seed(3)
    weight, bias = random_linear(1000, 2048, torch.bfloat16, True, gen)
    hidden = torch.randn(40, 3, 2048, device=DEVICE, generator=gen).to(torch.bfloat16)
    x = hidden[:, -1, :]  # 40 rows 3 * 2048 apart
    got = torch.ops.hf_paged.skinny_gemm_wgmma(x, weight, bias)
    assert_close_to_oracle(x, got, weight, bias, f"x {tuple(x.shape)} strides {x.stride()}")


@hopper_only
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_group_rows_match_float64(group, dtype, with_bias):
    assert_group_rows_match(torch.ops.hf_paged.skinny_gemm_wgmma_group, group, dtype, with_bias, ROWS)


@hopper_only
@pytest.mark.parametrize("case", ["1000x14336", "200x264", "130x8", "8b-tp2-qkv", "odd-four"])
def test_two_panels_a_step_match_float64(monkeypatch, case):
    """HF_PAGED_SKINNY_WGMMA_PANELS=2 (128 k a stage, three stages): the same answers, partial steps included."""
    monkeypatch.setenv("HF_PAGED_SKINNY_WGMMA_PANELS", "2")
    gen = torch.Generator(DEVICE).manual_seed(len(case))
    if case in GROUPS:
        weights, biases = random_group(case, torch.bfloat16, True, gen)
    else:
        n, k = map(int, case.split("x"))
        weight, bias = random_linear(n, k, torch.bfloat16, True, gen)
        weights, biases = [weight], [bias]
    for m in ROWS:
        x = torch.randn(m, weights[0].shape[1], device=DEVICE, generator=gen).to(torch.bfloat16)
        outs = torch.ops.hf_paged.skinny_gemm_wgmma_group(x, weights, biases)
        for i, (out, weight, bias) in enumerate(zip(outs, weights, biases, strict=True)):
            assert_close_to_oracle(x, out, weight, bias, f"two panels {case} M={m} weight {i}")


@hopper_only
@pytest.mark.parametrize("group", ["8b-tp2-qkv", "odd-four", None], ids=["tp2-qkv", "odd-four", "single-1000x2056"])
def test_graph_replay_with_new_data(group):
    assert_graph_replays_with_new_data(group)  # skinny.linear(_group) routed to the wgmma kernel by the switch


@hopper_only
def test_the_ops_refuse_bad_arguments_with_what_to_change():
    w = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(65, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="skinny_gemm_wgmma serves at most 64 rows"):
        torch.ops.hf_paged.skinny_gemm_wgmma(x, w, None)
    with pytest.raises(NotImplementedError, match="skinny_gemm_wgmma serves float16 and bfloat16"):
        torch.ops.hf_paged.skinny_gemm_wgmma(x[:9].float(), w.float(), None)
    with pytest.raises(ValueError, match="skinny_gemm_wgmma_group serves 1 to 4 weights"):
        torch.ops.hf_paged.skinny_gemm_wgmma_group(x[:9], [w] * 5, [None] * 5)


@pytest.mark.skipif(HOPPER, reason="off Hopper only")
def test_off_hopper_the_op_refuses_and_the_switch_keeps_the_wide_kernel():
    w = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(20, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="skinny_gemm_wgmma runs on compute capability 9.0 GPUs"):
        torch.ops.hf_paged.skinny_gemm_wgmma(x, w, None)
    assert torch.equal(skinny.linear(x, w), torch.ops.hf_paged.skinny_gemm_wide(x, w, None))


@hopper_only
def test_greedy_tokens_with_the_wgmma_kernel_equal_those_without(monkeypatch):
    assert_greedy_tokens_through(monkeypatch, "skinny_gemm_wgmma", "wgmma")
