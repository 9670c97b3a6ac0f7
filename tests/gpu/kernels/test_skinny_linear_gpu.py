"""On the GPU: the skinny linear kernel (hf_paged/csrc/skinny_gemm.cu) against a float64 oracle, in CUDA graphs, and in
a model's greedy decode.

Each case draws fresh inputs: weights of shape [N, K] for N in 8 .. 128256 (one and several tiles, split K across
warps and across clusters, rows past a tile's end) and K from 64 to 14336 (2056: a chunk of K past the last full one),
fp16/bf16, with and without bias, and x of 1 .. 8 rows; grouped launches (skinny_gemm_group) on the q/k/v and
gate/up shapes of Llama-3.2-1B and Llama-3.1-8B the same way. Every output row is judged on its own: each element
within the dtype's rounding of the float64 value plus 2^-16 of sum |x_k w_k| (fp32 accumulation on tensor cores),
and within twice that of cuBLAS (its reduced-precision reductions turned off; single products).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from greedy_oracle import CONFIG, NEW_TOKENS, assert_matches_up_to_ties
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_paged._forward_context import forward_context
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.kernels import _skinny as skinny

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DEVICE = torch.device("cuda")
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # largest relative error of rounding to the dtype
ACCUMULATION = 2.0**-16  # times sum |x_k w_k|
NS = (8, 512, 1000, 2048, 8192, 128256)
KS = (64, 2048, 2056, 4096, 8192, 14336)
# At most the 8B model's lm_head; 14336 x 4096 (the 8B model's gate/up) splits K in two per tile on an H100.
SHAPES = [(n, k) for n in NS for k in KS if n * k <= 128256 * 4096] + [(14336, 4096)]


# Products sharing x, as the compiled layers group them: (N of each weight, K).
GROUPS = {"1b-qkv": ((2048, 512, 512), 2048), "1b-gate-up": ((8192, 8192), 2048),
          "8b-qkv": ((4096, 1024, 1024), 4096), "8b-gate-up": ((14336, 14336), 4096)}


@pytest.fixture(autouse=True)
def kernel_at_every_size(monkeypatch):
    """The kernel at every shape here: the size rule that gives small single products to cuBLAS is off; more than 8
    rows go to F.linear."""
    monkeypatch.setattr(skinny, "CUBLAS_BELOW_BYTES", 0)


@pytest.fixture(autouse=True)
def full_precision_cublas():
    before = (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
              torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    yield
    (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
     torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction) = before


def random_linear(n: int, k: int, dtype: torch.dtype, with_bias: bool, gen: torch.Generator):
    """Weights scaled like a trained layer's (outputs of order 1)."""
    weight = (torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE, generator=gen).to(dtype) if with_bias else None
    return weight, bias


def oracle(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x @ weight.T + bias`` and ``|x| @ |weight|.T + |bias|``, over slices of the weight."""
    x64, values, scales = x.double(), [], []
    for rows in range(0, weight.shape[0], 16384):
        w64 = weight[rows:rows + 16384].double()
        values.append(x64 @ w64.T)
        scales.append(x64.abs() @ w64.abs().T)
    value, scale = torch.cat(values, 1), torch.cat(scales, 1)
    if bias is not None:
        value, scale = value + bias.double(), scale + bias.double().abs()
    return value, scale


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor, label: str) -> None:
    """Every element of each row within ``allowed``; the message names each failing row and its worst column."""
    excess = (got.double() - want).abs() - allowed  # [M, N]
    bad = [(m, int(excess[m].argmax())) for m in range(got.shape[0]) if bool((excess[m] > 0).any())]
    assert not bad, f"{label}: rows failing (row, worst n, got, want): " + ", ".join(
        f"({m}, {n}, {float(got[m, n]):.6g}, {float(want[m, n]):.6g})" for m, n in bad[:8])


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_rows_match_float64_and_cublas(n, k, dtype, with_bias):
    gen = torch.Generator(DEVICE).manual_seed(n * 31 + k + with_bias)
    weight, bias = random_linear(n, k, dtype, with_bias, gen)
    for m in range(1, skinny.MAX_ROWS + 1):
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
        assert skinny.kernel_serves(x, weight, bias)
        got = skinny.linear(x, weight, bias)
        want, scale = oracle(x, weight, bias)
        allowed = ROUNDING[dtype] * want.abs() + ACCUMULATION * scale + 1e-6
        label = f"M={m} N={n} K={k} {dtype} bias={with_bias}"
        assert got.shape == (m, n) and got.dtype == dtype
        assert_rows_close(got, want, allowed, label)
        assert_rows_close(got, F.linear(x, weight, bias).double(), 2 * allowed, label + " vs cuBLAS")


def test_leading_dims_and_strided_rows_are_served():
    gen = torch.Generator(DEVICE).manual_seed(3)
    weight, bias = random_linear(1000, 2048, torch.bfloat16, True, gen)
    hidden = torch.randn(4, 5, 2048, device=DEVICE, generator=gen).to(torch.bfloat16)
    for x in (hidden[:, -1:, :], hidden[:1], hidden[0, 1]):  # 4 rows 5 * 2048 apart; [1, 5, K]; a single [K]
        assert skinny.kernel_serves(x, weight, bias)
        got = skinny.linear(x, weight, bias)
        assert got.shape == (*x.shape[:-1], 1000) and got.is_contiguous()
        rows = x.reshape(-1, 2048)
        want, scale = oracle(rows, weight, bias)
        assert_rows_close(got.reshape(-1, 1000), want, ROUNDING[torch.bfloat16] * want.abs() + ACCUMULATION * scale,
                          f"x {tuple(x.shape)} strides {x.stride()}")
        assert torch.equal(got.reshape(-1, 1000), torch.ops.hf_paged.skinny_gemm(rows, weight, bias))


def test_one_allocation_per_call():
    gen = torch.Generator(DEVICE).manual_seed(4)
    weight, bias = random_linear(512, 2048, torch.bfloat16, True, gen)
    x = torch.randn(8, 2048, device=DEVICE, generator=gen).to(torch.bfloat16)
    skinny.linear(x, weight, bias)  # warm: the kernels are loaded
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    skinny.linear(x, weight, bias)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 1  # the output


@pytest.mark.parametrize("case", ["9 rows", "33 rows", "0 rows", "K % 8", "float32", "weight view"])
def test_what_the_kernel_does_not_serve_is_f_linear(case):
    gen = torch.Generator(DEVICE).manual_seed(5)
    rows = {"9 rows": 9, "33 rows": 33, "0 rows": 0}.get(case, 4)
    k = 2044 if case == "K % 8" else 2048
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    weight, bias = random_linear(512, k, dtype, True, gen)
    if case == "weight view":
        weight = random_linear(k, 512, dtype, False, gen)[0].t()
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(dtype)
    assert not skinny.kernel_serves(x, weight, bias)
    assert torch.equal(skinny.linear(x, weight, bias), F.linear(x, weight, bias))


def test_the_op_refuses_bad_arguments_with_what_to_change():
    w = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(9, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 8 rows"):
        torch.ops.hf_paged.skinny_gemm(x, w, None)
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        torch.ops.hf_paged.skinny_gemm(x[:2], w.half(), None)
    with pytest.raises(ValueError, match=r"x must be \[rows, K\]"):
        torch.ops.hf_paged.skinny_gemm(x[:2, :32], w, None)
    with pytest.raises(NotImplementedError, match="float16 and bfloat16"):
        torch.ops.hf_paged.skinny_gemm(x[:2].float(), w.float(), None)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        torch.ops.hf_paged.skinny_gemm(x[:2], w, torch.zeros(8, device=DEVICE, dtype=torch.bfloat16))


@pytest.mark.parametrize(("n", "k"), [(512, 2048), (2048, 8192), (8192, 2048), (1000, 2056)])
def test_graph_replay_with_new_data(n, k):
    gen = torch.Generator(DEVICE).manual_seed(n + k)
    weight, bias = random_linear(n, k, torch.bfloat16, True, gen)
    x = torch.randn(8, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny.linear(x, weight, bias)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny.linear(x, weight, bias)
    for step in range(3):
        new_weight, new_bias = random_linear(n, k, torch.bfloat16, True, gen)
        weight.copy_(new_weight)
        bias.copy_(new_bias)
        x.copy_(torch.randn(8, k, device=DEVICE, generator=gen))
        graph.replay()
        want, scale = oracle(x, weight, bias)
        assert_rows_close(out, want, ROUNDING[torch.bfloat16] * want.abs() + ACCUMULATION * scale,
                          f"replay {step} N={n} K={k}")


def random_group(group: str, dtype: torch.dtype, with_bias: bool, gen: torch.Generator):
    """The group's weights and biases (the second weight never has a bias: groups mix both)."""
    widths, k = GROUPS[group]
    pairs = [random_linear(n, k, dtype, with_bias and i != 1, gen) for i, n in enumerate(widths)]
    return [w for w, _ in pairs], [b for _, b in pairs]


def assert_group_close(x, outs, weights, biases, label: str) -> None:
    assert len(outs) == len(weights)
    for i, (out, weight, bias) in enumerate(zip(outs, weights, biases, strict=True)):
        want, scale = oracle(x, weight, bias)
        assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype and out.is_contiguous()
        assert_rows_close(out, want, ROUNDING[x.dtype] * want.abs() + ACCUMULATION * scale + 1e-6,
                          f"{label} weight {i}")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_group_rows_match_float64(group, dtype, with_bias, monkeypatch):
    monkeypatch.setattr(skinny, "CUBLAS_BELOW_BYTES", 16 << 20)  # the default: groups take the kernel anyway
    gen = torch.Generator(DEVICE).manual_seed(len(group) * 13 + with_bias)
    weights, biases = random_group(group, dtype, with_bias, gen)
    for m in range(1, skinny.MAX_ROWS + 1):
        x = torch.randn(m, GROUPS[group][1], device=DEVICE, generator=gen).to(dtype)
        outs = torch.ops.hf_paged.skinny_gemm_group(x, weights, biases)
        assert_group_close(x, outs, weights, biases, f"{group} M={m} {dtype} bias={with_bias}")
        served = skinny.linear_group(x, weights, biases)
        assert all(torch.equal(a, b) for a, b in zip(served, outs, strict=True)), "linear_group should launch it"


@pytest.mark.parametrize("group", ["1b-qkv", "8b-gate-up"])
def test_group_graph_replay_with_new_data(group):
    gen = torch.Generator(DEVICE).manual_seed(len(group))
    weights, biases = random_group(group, torch.bfloat16, True, gen)
    x = torch.randn(8, GROUPS[group][1], device=DEVICE, generator=gen).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny.linear_group(x, weights, biases)  # warm-up outside the capture
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        skinny.linear_group(x, weights, biases)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == len(weights)  # the outputs
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = skinny.linear_group(x, weights, biases)
    for step in range(3):
        fresh, fresh_biases = random_group(group, torch.bfloat16, True, gen)
        for old, new in zip([*weights, *biases], [*fresh, *fresh_biases], strict=True):
            if old is not None:
                old.copy_(new)
        x.copy_(torch.randn(x.shape, device=DEVICE, generator=gen))
        graph.replay()
        assert_group_close(x, outs, weights, biases, f"{group} replay {step}")


def test_group_refusals_say_what_to_do():
    w = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 4 weights"):
        torch.ops.hf_paged.skinny_gemm_group(x, [w] * 5, [None] * 5)
    with pytest.raises(ValueError, match="one entry"):
        torch.ops.hf_paged.skinny_gemm_group(x, [w, w], [None])
    with pytest.raises(ValueError, match=r"x must be \[rows, K\]"):
        torch.ops.hf_paged.skinny_gemm_group(x, [w, w[:, :32].contiguous()], [None, None])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="inductor needs triton on CUDA")
def test_inductor_compiled_mlp_runs_the_op_for_every_row_count():
    torch._dynamo.reset()
    model = tiny_llama()
    skinny_linear.install(model)
    mlp = model.model.layers[0].mlp
    compiled = torch.compile(mlp, dynamic=True, fullgraph=True)
    with torch.no_grad(), forward_context(skinny_linears=True):
        for rows in (1, 3, 8, 9, 40, 64, 80):
            x = torch.randn(rows, 1, CONFIG["hidden_size"], device=DEVICE, dtype=torch.bfloat16)
            want = mlp(x)
            torch.testing.assert_close(compiled(x), want, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="sdpa",
                                            dtype=torch.bfloat16).to(DEVICE).eval()


def greedy_batch(lengths: list[int], seed: int) -> dict:
    """``generate`` arguments for left-padded random prompts of ``lengths`` (one decode row each)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(3, CONFIG["vocab_size"], (n,), generator=gen)
        mask[i, -n:] = 1
    return dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0, eos_token_id=None)


def assert_greedy_matches(model, batch: dict, label: str) -> None:
    """The tokens ``model`` generates for ``batch`` through the skinny routing (installed, then active) equal those
    it generates without (outside ``active``) up to ties."""
    skinny_linear.install(model)
    ref = model.generate(**batch, return_dict_in_generate=True, output_logits=True)
    top2 = torch.stack(ref.logits, 1).float().topk(2, dim=-1).values
    with forward_context(skinny_linears=True):
        got = model.generate(**batch)
    width = batch["input_ids"].shape[1]
    assert_matches_up_to_ties(got[:, width:], ref.sequences[:, width:], top2[..., 0] - top2[..., 1], label)


def test_greedy_tokens_with_the_kernel_equal_those_without(monkeypatch):
    model = tiny_llama()
    batch = greedy_batch([1, 15, 17, 100, 300, 7], seed=1)  # six rows: decode steps run the kernel with M = 6
    served = []
    kernel_input = skinny._kernel_input

    def counted(*args):
        rows = kernel_input(*args)
        served.append(rows is not None)
        return rows

    monkeypatch.setattr(skinny, "_kernel_input", counted)
    assert_greedy_matches(model, batch, "skinny linear")
    patched = skinny_linear.install(model)
    assert len(patched) == 7 * CONFIG["num_hidden_layers"] + 1
    assert sum(served) >= len(patched) * (NEW_TOKENS - 1), "the decode steps should run the kernel"
