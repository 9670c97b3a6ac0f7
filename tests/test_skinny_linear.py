"""The skinny linear on the CPU: the ``hf_paged::linear`` op falls back to ``F.linear`` bit for bit, traces as one
opaque call under ``torch.compile`` (no guard on the row count), and ``skinny_linear.install`` / ``active`` route a
model's linear layers through it only while active (the GPU kernel itself: tests/gpu/test_skinny_linear_gpu.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, make_config
from transformers import AutoModelForCausalLM

from hf_paged.engine import skinny_linear
from hf_paged.kernels import build, skinny


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
        assert calls == [] and not skinny_linear.is_active()
        with skinny_linear.active():
            with skinny_linear.active():
                pass
            assert skinny_linear.is_active()  # nesting restores the outer state
            inside = model(ids).logits
        assert not skinny_linear.is_active()
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
        with skinny_linear.active():
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
    with skinny_linear.active():
        assert torch.equal(model.generate(ids, **kwargs), before)


def test_install_needs_decoder_layers():
    with pytest.raises(ValueError, match="no list of decoder layers"):
        skinny_linear.install(torch.nn.Sequential(torch.nn.Linear(8, 8)))


def test_the_benchmark_says_it_needs_a_gpu(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import skinny_gemm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        skinny_gemm.main(["--rows", "1"])
