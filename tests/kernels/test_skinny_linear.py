"""The skinny linear on the CPU: the ``hf_paged::linear`` op falls back to ``F.linear`` bit for bit, traces as one
opaque call under ``torch.compile`` (no guard on the row count), routes rows to the kernel's ops by count (1 to 8;
the ops faked on the CPU), and ``skinny_linear.install`` / ``active`` route a model's linear layers through it only
while active (the GPU kernel itself: tests/gpu/kernels/test_skinny_linear_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, make_config
from transformers import AutoModelForCausalLM

from hf_paged import _forward_context
from hf_paged._forward_context import forward_context
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.kernels import _build as build
from hf_paged.kernels import _skinny as skinny


class RecordingBackend:
    """A torch.compile backend that keeps every graph it is given and runs it as is."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_calls(self, index: int = -1) -> int:
        ops = (torch.ops.hf_paged.linear, torch.ops.hf_paged.linear.default)
        return sum(any(node.target is op for op in ops) for node in self.graphs[index].graph.nodes)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_llama(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config("llama_gqa"), attn_implementation="eager", dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 4), (5, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_op_on_cpu_is_f_linear_bit_for_bit(dtype, lead, with_bias):
    gen = torch.Generator().manual_seed(len(lead) * 7 + with_bias)
    x = torch.randn(*lead, 72, generator=gen).to(dtype)
    weight = torch.randn(40, 72, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype) if with_bias else None
    out = skinny.linear(x, weight, bias)
    assert torch.equal(out, F.linear(x, weight, bias)) and out.is_contiguous()
    assert not skinny.kernel_serves(x, weight, bias)


def test_training_keeps_autograd():
    x = torch.randn(2, 16, requires_grad=True)
    layer = torch.nn.Linear(16, 8)
    skinny.linear(x, layer.weight, layer.bias).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_max_rows_matches_the_kernel():
    header = (build.CSRC / "skinny_gemm.h").read_text()
    assert int(re.search(r"kSkinnyMaxRows = (\d+);", header).group(1)) == skinny.MAX_ROWS
    assert {"skinny_gemm.cu", "skinny_ops.cpp"} <= set(build.SOURCES)


REAL_LINEAR = F.linear  # the tests below record calls to F.linear; the fake kernels compute with this one


@pytest.fixture
def fake_kernels(monkeypatch):
    """The kernel's two ops as F.linear on the CPU, each call recorded as (op name, rows of x); CPU tensors pass
    the kernels' device check and the kernels count as loaded. Every weight size takes the kernel (no cuBLAS rule)."""
    calls = []

    def single(name):
        def op(x, weight, bias=None):
            calls.append((name, x.shape[0]))
            return REAL_LINEAR(x, weight, bias)
        return op

    def group(name):
        def op(x, weights, biases):
            calls.append((name, x.shape[0]))
            return [REAL_LINEAR(x, w, b) for w, b in zip(weights, biases, strict=True)]
        return op

    monkeypatch.setattr(torch.ops.hf_paged, "skinny_gemm", single("skinny_gemm"), raising=False)
    monkeypatch.setattr(torch.ops.hf_paged, "skinny_gemm_group", group("skinny_gemm_group"), raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(skinny, "_kernels_loaded", lambda: True)
    monkeypatch.setattr(skinny, "CUBLAS_BELOW_BYTES", 0)
    return calls


@pytest.mark.parametrize("rows", [1, 8, 9, 16, 17, 33, 64, 65])
def test_up_to_max_rows_reach_the_kernel(fake_kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    weights = [torch.randn(n, 64, generator=gen).to(torch.bfloat16) for n in (40, 24)]
    biases = [torch.randn(40, generator=gen).to(torch.bfloat16), None]
    want = [REAL_LINEAR(x, w, b) for w, b in zip(weights, biases, strict=True)]
    op = "skinny_gemm" if rows <= skinny.MAX_ROWS else None
    assert skinny.kernel_serves(x, weights[0], biases[0]) == (op is not None)
    assert torch.equal(skinny.linear(x, weights[0], biases[0]), want[0])
    assert fake_kernels == ([(op, rows)] if op else [])
    fake_kernels.clear()
    outs = skinny.linear_group(x, weights, biases)
    assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))
    assert fake_kernels == ([(f"{op}_group", rows)] if op else [])


def test_leading_dims_count_as_rows(fake_kernels):
    weight = torch.randn(24, 32, dtype=torch.bfloat16)
    for x in (torch.randn(2, 4, 32, dtype=torch.bfloat16), torch.randn(4, 5, 32, dtype=torch.bfloat16)):
        out = skinny.linear(x, weight)
        assert out.shape == (*x.shape[:-1], 24) and torch.equal(out, REAL_LINEAR(x, weight))
    assert fake_kernels == [("skinny_gemm", 8)]  # 20 rows: F.linear


@pytest.mark.parametrize("case", ["0 rows", "9 rows", "K % 8", "float32", "weight view", "bias view"])
def test_what_the_kernel_does_not_serve_is_f_linear(fake_kernels, case):
    rows, k = {"0 rows": 0, "9 rows": 9}.get(case, 5), 60 if case == "K % 8" else 64
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x, weight = torch.randn(rows, k).to(dtype), torch.randn(48, k).to(dtype)
    bias = torch.randn(96).to(dtype)[::2] if case == "bias view" else None  # not contiguous
    if case == "weight view":
        weight = torch.randn(k, 48).to(dtype).t()
    assert not skinny.kernel_serves(x, weight, bias)
    assert torch.equal(skinny.linear(x, weight, bias), REAL_LINEAR(x, weight, bias))
    assert torch.equal(skinny.linear_group(x, [weight, weight], [bias, None])[0], REAL_LINEAR(x, weight, bias))
    assert fake_kernels == []


@pytest.mark.parametrize("rows", [2, 16], ids=["kernel", "f_linear"])
def test_weights_end_to_end_take_the_kernel_up_to_max_rows_else_one_f_linear(fake_kernels, monkeypatch, rows):
    gen = torch.Generator().manual_seed(5)
    buffer = torch.randint(-4, 5, (40, 32), generator=gen).to(torch.bfloat16)  # q/k/v of 24, 8, 8 rows end to end
    weights, x = [buffer[:24], buffer[24:32], buffer[32:]], torch.randint(-4, 5, (rows, 32), generator=gen).bfloat16()
    assert skinny.packed_rows(weights, [None] * 3) is not None
    linear_calls = []
    monkeypatch.setattr(skinny.F, "linear", lambda *a: linear_calls.append(a[1].shape) or REAL_LINEAR(*a))
    outs = skinny.linear_group(x, weights, [None] * 3)
    assert all(torch.equal(o, REAL_LINEAR(x, w)) and o.shape == (rows, w.shape[0])
               for o, w in zip(outs, weights, strict=True))
    if rows <= skinny.MAX_ROWS:
        assert fake_kernels == [("skinny_gemm_group", rows)] and linear_calls == []
    else:
        assert fake_kernels == [] and linear_calls == [torch.Size([40, 32])]


def test_a_compiled_call_routes_rows_when_it_runs(fake_kernels):
    recording = RecordingBackend()
    fn = torch.compile(lambda x, w: skinny.linear(x, w) * 2, fullgraph=True, dynamic=True, backend=recording)
    weight = torch.randn(24, 32, dtype=torch.bfloat16)
    for rows in (5, 20, 70):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        assert torch.equal(fn(x, weight), REAL_LINEAR(x, weight) * 2)
    assert fake_kernels == [("skinny_gemm", 5)]
    assert len(recording.graphs) == 1 and recording.op_calls() == 1


@pytest.mark.parametrize("backend", ["recording", "aot_eager"])
def test_op_compiles_as_one_opaque_call_without_a_guard_on_rows(backend):
    recording = RecordingBackend()
    fn = torch.compile(lambda x, w, b: skinny.linear(x, w, b) * 2, fullgraph=True, dynamic=True,
                       backend=recording if backend == "recording" else backend)
    weight, bias = torch.randn(24, 32), torch.randn(24)
    for rows in (2, 5, 9, 16):  # both sides of MAX_ROWS: the op decides inside, so one graph serves all
        x = torch.randn(rows, 3, 32)
        assert torch.equal(fn(x, weight, bias), F.linear(x, weight, bias) * 2)
    if backend == "recording":
        assert len(recording.graphs) == 1 and recording.op_calls() == 1


def test_install_patches_every_layer_linear_and_the_head_once():
    model = tiny_llama()
    patched = skinny_linear.install(model)
    expected = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)] + [model.lm_head]
    assert len(expected) == 2 * 7 + 1 and [id(m) for m in patched] == [id(m) for m in expected]
    forwards = [m.forward for m in patched]
    assert [id(m) for m in skinny_linear.install(model)] == [id(m) for m in patched]
    assert all(m.forward is f for m, f in zip(patched, forwards, strict=True))
    assert isinstance(model.model.embed_tokens.forward.__self__, torch.nn.Embedding)  # untouched


def test_outside_active_the_original_forward_runs_and_inside_the_op(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    patched = skinny_linear.install(model)
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a: calls.append(a[1].shape) or real(*a))
    with torch.no_grad():
        outside = model(ids).logits
        assert calls == [] and not _forward_context.skinny_linears()
        with forward_context(skinny_linears=True):
            with forward_context(skinny_linears=True):
                pass
            assert _forward_context.skinny_linears()  # nesting restores the outer state
            inside = model(ids).logits
        assert not _forward_context.skinny_linears()
    assert len(calls) == len(patched)
    assert torch.equal(outside, before) and torch.equal(inside, before)  # the CPU fallback is F.linear itself


def test_a_compiled_layer_guards_on_active():
    model = tiny_llama()
    skinny_linear.install(model)
    mlp, recording = model.model.layers[0].mlp, RecordingBackend()
    compiled = torch.compile(mlp, fullgraph=True, dynamic=True, backend=recording)
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        reference = mlp(x)
        assert torch.equal(compiled(x), reference) and recording.op_calls() == 0
        with forward_context(skinny_linears=True):
            assert torch.equal(compiled(x), reference) and recording.op_calls() == 3
        assert torch.equal(compiled(x), reference) and len(recording.graphs) == 2  # the first graph again


def test_unusual_modules_are_left_alone():
    class Quantized(torch.nn.Linear):
        pass

    class Subclass(torch.Tensor):
        pass

    model = tiny_llama()
    layer = model.model.layers[0]
    layer.mlp.gate_proj = Quantized(64, 128, bias=False, dtype=torch.bfloat16)
    layer.mlp.up_proj.weight = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16).t())  # not contiguous
    layer.mlp.down_proj = torch.nn.Linear(128, 64, bias=False, device="meta", dtype=torch.bfloat16)
    layer.self_attn.q_proj.float()  # another dtype than the layers'
    layer.self_attn.k_proj.weight = torch.nn.Parameter(Subclass(layer.self_attn.k_proj.weight.data))
    odd = torch.nn.Linear(60, 64, bias=False, dtype=torch.bfloat16)  # K not a multiple of 8
    layer.self_attn.v_proj = odd
    patched = skinny_linear.install(model)
    skipped = [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, layer.self_attn.q_proj,
               layer.self_attn.k_proj, odd]
    assert len(patched) == 15 - len(skipped) and all(all(m is not s for m in patched) for s in skipped)
    assert all("forward" not in m.__dict__ for m in skipped)


def test_a_float32_model_is_not_patched_and_uninstall_restores():
    assert skinny_linear.install(tiny_llama(torch.float32)) == []
    model = tiny_llama()
    skinny_linear.install(model)
    skinny_linear.uninstall(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert skinny_linear.install(model)  # and can be installed again


def test_tiny_llama_generates_the_same_tokens_when_active():
    model = tiny_llama()
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    before = model.generate(ids, **kwargs)
    skinny_linear.install(model)
    with forward_context(skinny_linears=True):
        assert torch.equal(model.generate(ids, **kwargs), before)


def test_install_needs_decoder_layers():
    with pytest.raises(ValueError, match="no list of decoder layers"):
        skinny_linear.install(torch.nn.Sequential(torch.nn.Linear(8, 8)))


def benchmark():
    from benchmarks.kernels import skinny_gemm

    return skinny_gemm


def test_the_benchmark_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        benchmark().main(["--rows", "1"])
    with pytest.raises(SystemExit):
        benchmark().main(["--rows", "4,9"])  # past the kernel: refused before anything runs


def test_the_benchmark_adds_up_a_tensor_parallel_step_as_the_engine_runs_it():
    bench = benchmark()
    spec = bench.MODELS["8b-tp2"]
    products = {**{name: (name,) for name in spec["shapes"]}, **{g: bench.group_shapes(spec, g) for g in bench.GROUPS}}
    assert products["q+k+v"] == ("q", "k/v", "k/v") and bench.group_shapes(bench.MODELS["8b"], "q+k+v")[0] == "q/o"
    # cuBLAS 10 us a call, the kernel 1 us, a group 3 us; o is small enough for cuBLAS
    rows = [dict(model=spec["name"], shape=name, rows=8, cublas_us=10.0, small=name == "o",
                 skinny_us=3.0 if name in bench.GROUPS else 1.0) for name in products]
    (line,) = bench.step_totals(rows, ["8b-tp2"], [8])
    # per layer: cuBLAS q, k, v, o, gate, up, down = 70 us; single launches 7 us; the engine: two groups (6 us), o on
    # cuBLAS (10 us), down on the kernel (1 us); then lm_head's half of the vocabulary once per step (10 / 1 / 1 us)
    assert line == (f"{spec['name']} M=8: a decode step's linears take {32 * 70 + 10} us with cuBLAS, "
                    f"{32 * 7 + 1} us with single skinny launches, {32 * 17 + 1} us as the engine runs them (grouped)")


def test_the_benchmarks_packed_group_is_the_separate_products_and_its_table_shows_the_extra_columns():
    """--extra's ``packed`` system: one product over a copy of the group's weights end to end, split, equals the
    separate products; the table gains a column per extra system ("-" where a row has none)."""
    bench = benchmark()
    gen = torch.Generator().manual_seed(0)
    sets = [[torch.randn(n, 16, generator=gen) for n in (8, 4, 4)] for _ in range(2)]
    x = torch.randn(3, 16, generator=gen)
    extra = bench.extra_systems(True, sets)
    assert set(extra) == {"cublaslt", "packed"} and set(bench.extra_systems(False, [s[0] for s in sets])) == {"cublaslt"}
    for ws in sets:  # each set its own packed copy
        got = extra["packed"](x, ws)
        assert [tuple(o.shape) for o in got] == [(3, 8), (3, 4), (3, 4)]
        assert all(torch.allclose(o, x @ w.T, atol=1e-5) for o, w in zip(got, ws))
    base = dict(model="m", n=16, k=16, rows=3, cublas_us=2.0, skinny_us=1.0, speedup=2.0, cublas_gbs=1.0,
                skinny_gbs=2.0, cublas_pct_copy=1.0, skinny_pct_copy=2.0, cublaslt_us=1.5)
    lines = bench.table([{**base, "shape": "q+k+v", "packed_us": 1.25}, {**base, "shape": "o"}]).splitlines()
    assert lines[0].endswith("| cublaslt us | packed us |")
    assert lines[2].endswith("| 1.5 | 1.2 |") and lines[3].endswith("| 1.5 | - |")
