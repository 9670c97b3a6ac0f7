"""Grouped skinny linears on the CPU: ``hf_paged::linear_group`` falls back to one ``F.linear`` per weight bit for
bit and traces under ``torch.compile``; the ``GroupLinears`` pass turns the ``hf_paged.linear`` calls that share an
input into grouped calls, directly on an FX graph and inside inductor (the engine's compiled layers included). The
grouped kernel itself: tests/gpu/kernels/test_skinny_linear_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, make_config
from torch._inductor.utils import run_and_get_code
from transformers import AutoModelForCausalLM

from hf_paged._forward_context import forward_context
from hf_paged.compile import _layers as compiled_layers
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.compile._group_linears import GroupLinears, group_linears
from hf_paged.kernels import _skinny as skinny

LINEAR, GROUP = torch.ops.hf_paged.linear.default, torch.ops.hf_paged.linear_group.default


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class SharedInput(torch.nn.Module):
    """``widths`` linears of K=32 on one input (bias on every other one), one of K=16 on a slice of it, one on
    another input."""

    def __init__(self, widths: tuple[int, ...]):
        super().__init__()
        self.shared = torch.nn.ModuleList(torch.nn.Linear(32, n, bias=i % 2 == 0) for i, n in enumerate(widths))
        self.narrow, self.other = torch.nn.Linear(16, 8), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        h = x * 2
        linear = torch.ops.hf_paged.linear  # as skinny.linear puts it in a compiled graph
        outs = [linear(h, m.weight, m.bias) for m in self.shared]
        return [*outs, linear(h[..., :16], self.narrow.weight, self.narrow.bias),
                linear(y, self.other.weight, self.other.bias)]


def traced(module: torch.nn.Module, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    """The ATen-level graph of ``module`` with its parameters as the first inputs (as inductor's post-grad passes
    see it), fake values in its meta; call it as ``gm(params, *inputs)``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(params, *args):
        return torch.func.functional_call(module, params, args)

    with torch.no_grad():
        return make_fx(call, tracing_mode="fake")(params_of(module), *inputs)


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters()}


def count(gm: torch.fx.GraphModule, target) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_group_on_cpu_is_f_linear_bit_for_bit(dtype, with_bias):
    gen = torch.Generator().manual_seed(7 + with_bias)
    x = torch.randn(2, 3, 48, generator=gen).to(dtype)
    weights = [torch.randn(n, 48, generator=gen).to(dtype) for n in (40, 8, 8)]
    biases = [torch.randn(w.shape[0], generator=gen).to(dtype) if with_bias and i != 1 else None
              for i, w in enumerate(weights)]
    outs = skinny.linear_group(x, weights, biases)
    for out, w, b in zip(outs, weights, biases, strict=True):
        assert torch.equal(out, F.linear(x, w, b)) and out.is_contiguous()
    with pytest.raises(ValueError, match="one bias"):
        skinny.linear_group(x, weights, biases[:2])


def _end_to_end(sizes: tuple[int, ...], k: int, gen, dtype=torch.float32, offset: int = 3) -> list[torch.Tensor]:
    """Weights ``[n, k]`` that lie end to end in one buffer (after ``offset`` unused rows), with small integer values:
    every product is exact, so a single product over all of them must equal the separate ones bit for bit."""
    buffer = torch.randint(-4, 5, (offset + sum(sizes), k), generator=gen).to(dtype)
    bounds = [offset + sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [buffer[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("with_bias", [False, True])
def test_weights_end_to_end_in_one_buffer_run_as_one_product(monkeypatch, with_bias):
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (2, 16, 24), generator=gen).float()  # 32 rows: past the skinny kernel's 8
    weights = _end_to_end((16, 8, 8), 24, gen)
    biases = _end_to_end((16, 8, 8), 1, gen) if with_bias else [None] * 3
    biases = [b.view(-1) if b is not None else None for b in biases]
    assert skinny.packed_rows(weights, biases) is not None
    calls, linear = [], F.linear
    monkeypatch.setattr(skinny.F, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    outs = skinny.linear_group(x, weights, biases)
    assert calls == [torch.Size([32, 24])]  # one product over the three weights
    for out, w, b in zip(outs, weights, biases, strict=True):
        assert torch.equal(out, linear(x, w, b)) and out.is_contiguous() and out.shape == (2, 16, w.shape[0])


def test_weights_not_end_to_end_run_one_product_each():
    gen = torch.Generator().manual_seed(4)
    q, k, v = _end_to_end((16, 8, 8), 24, gen)
    apart = [torch.randn(8, 24, generator=gen), torch.randn(8, 24, generator=gen)]
    cases = {
        "out of order": ([q, v, k], [None] * 3),
        "separate buffers": (apart, [None] * 2),
        "one alone": ([q], [None]),
        "a bias missing": ([q, k], [torch.zeros(16), None]),
        "biases apart": ([q, k], [torch.zeros(16), torch.zeros(8)]),
        "another K": ([q, torch.randn(16, 32)[:, :24].contiguous()], [None] * 2),
        "another dtype": ([q, k.double()], [None] * 2),
    }
    for name, (weights, biases) in cases.items():
        assert skinny.packed_rows(weights, biases) is None, name
    x = torch.randn(20, 24, generator=gen)
    outs = skinny.linear_group(x, [q, v, k], [None] * 3)
    assert all(torch.equal(o, F.linear(x, w)) for o, w in zip(outs, [q, v, k], strict=True))


def test_group_op_traces_under_fullgraph_with_dynamic_rows():
    weights = [torch.randn(24, 32), torch.randn(8, 32)]
    biases = [torch.randn(24), None]
    fn = torch.compile(lambda x, a, b, c: [o * 2 for o in skinny.linear_group(x, [a, b], [c, None])],
                       fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (1, 5, 12):
        x = torch.randn(rows, 32)
        got = fn(x, weights[0], weights[1], biases[0])
        assert all(torch.equal(g, F.linear(x, w, b) * 2) for g, w, b in zip(got, weights, biases, strict=True))


def test_small_single_products_go_to_cublas_by_the_measured_rule():
    def weight(n, k):
        return torch.empty(n, k, dtype=torch.bfloat16, device="meta")

    assert not skinny.kernel_wins(weight(2048, 2048)) and not skinny.kernel_wins(weight(512, 2048))  # 1B q/o, k/v
    assert skinny.kernel_wins(weight(1024, 4096)) and skinny.kernel_wins(weight(8192, 2048))  # 8B k/v, 1B gate/up
    assert skinny.kernel_wins(weight(2048, 8192)) and skinny.kernel_wins(weight(128256, 2048))  # 1B down, lm_head


@pytest.mark.parametrize(("widths", "groups", "singles"), [((64, 16, 16), 1, 2), ((8, 8), 1, 2),
                                                            ((8, 16, 24, 32, 40), 1, 3), ((8,), 0, 3)])
def test_the_pass_groups_calls_on_one_input_and_keeps_the_results(widths, groups, singles):
    torch.manual_seed(len(widths))
    module = SharedInput(widths).eval()
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    gm = traced(module, x, y)
    assert count(gm, LINEAR) == len(widths) + 2
    assert group_linears(gm.graph) == groups
    gm.graph.lint()
    gm.recompile()
    # five on one input: one group of four (MAX_GROUP) and one left single; the K=16 and other-input calls stay
    assert count(gm, GROUP) == groups and count(gm, LINEAR) == singles
    with torch.no_grad():
        for got, want in zip(gm(params_of(module), x, y), module(x, y), strict=True):
            assert torch.equal(got, want)


@pytest.mark.slow  # inductor's compile: several seconds on a 2-core CPU
def test_inductor_runs_the_pass_from_the_compile_options():
    torch.manual_seed(0)
    module = SharedInput((64, 16, 16)).eval()
    compiled = torch.compile(module, dynamic=True, fullgraph=True,
                             options={"post_grad_custom_pre_pass": GroupLinears()})
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    with torch.no_grad():
        got, (code,) = run_and_get_code(compiled, x, y)
        want = module(x, y)
    assert code.count("= torch.ops.hf_paged.linear_group.default(") == 1
    assert code.count("= torch.ops.hf_paged.linear.default(") == 2
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-5) for g, w in zip(got, want, strict=True))


def test_the_pass_keys_the_fx_graph_cache():
    assert GroupLinears().uuid() == GroupLinears().uuid() and GroupLinears().uuid()


@pytest.mark.slow
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "apart"])
def test_tiny_llama_with_compiled_layers_groups_qkv_and_gate_up_and_keeps_the_logits(monkeypatch, packed):
    """The model's first compile lays q/k/v and gate/up end to end, so each group is one product sliced into views
    (``linear_packed``); weights left apart (packing refused) run as a grouped call each."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama_gqa"), attn_implementation="eager",
                                             dtype=torch.bfloat16).eval()
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits.float()
    skinny_linear.install(model)
    if not packed:
        monkeypatch.setattr(compiled_layers, "pack_siblings", lambda model: 0)
    layers = compiled_layers.compiled_layers(model)
    attn = model.model.layers[0].self_attn
    qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert (skinny.packed_rows(qkv, [None] * 3) is not None) == packed
    with torch.no_grad(), layers.active(), forward_context(skinny_linears=True), \
            torch._inductor.config.patch(fx_graph_cache=False):  # every layer's code, not cache hits
        got, codes = run_and_get_code(lambda: model(ids).logits.float())
    assert layers.enabled, layers.failure
    layer_codes = [c for c in codes if "hf_paged" in c]
    assert len(layer_codes) == model.config.num_hidden_layers
    grouped = "linear_packed" if packed else "linear_group"
    for code in layer_codes:  # q/k/v and gate/up grouped; o_proj and down_proj single
        assert code.count(f"= torch.ops.hf_paged.{grouped}.default(") == 2
        assert code.count("= torch.ops.hf_paged.linear.default(") == 2
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# ----- end-to-end weights as views of one product ------------------------------------------------------------
PACKED = torch.ops.hf_paged.linear_packed.default
import hf_paged.attention.backends._torch  # noqa: E402,F401  (registers the "torch" KV writer)


class PackedQKV(torch.nn.Module):
    """q/k/v linears of K=24 whose weights (and biases) lie end to end in one buffer, as ``tp_linears`` packs a
    rank's shards (``apart``: each in its own buffer), called out of their memory order; v goes through a custom op
    that keeps its eager strides (the KV write), q and k through pointwise work."""

    def __init__(self, apart: bool = False, with_bias: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        weights = _end_to_end((16, 8, 8), 24, gen)
        biases = [b.view(-1) for b in _end_to_end((16, 8, 8), 1, gen)] if with_bias else [None] * 3
        if apart:
            weights = [w.clone() for w in weights]
            biases = [b.clone() if b is not None else None for b in biases]
        for name, w, b in zip("qkv", weights, biases, strict=True):
            self.register_parameter(f"{name}_weight", torch.nn.Parameter(w, requires_grad=False))
            self.register_parameter(f"{name}_bias", None if b is None else torch.nn.Parameter(b, requires_grad=False))

    def forward(self, x, k_cache, v_cache, slots):
        linear = torch.ops.hf_paged.linear
        v = linear(x, self.v_weight, self.v_bias)
        k = linear(x, self.k_weight, self.k_bias)
        q = linear(x, self.q_weight, self.q_bias)
        torch.ops.hf_paged.store_kv(torch.sin(k).view(-1, 2, 4), v.view(-1, 2, 4), k_cache, v_cache, slots, "torch",
                                    False)
        return (q * 2).view(-1, 4, 4), v + 1


def _kv_inputs(rows: int):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-4, 5, (rows, 24), generator=gen).float()
    return x, torch.zeros(4, 4, 2, 4), torch.zeros(4, 4, 2, 4), torch.randperm(16, generator=gen)[:rows]


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_packed_is_the_products_side_by_side_in_one_product_where_the_weights_lie_end_to_end(monkeypatch,
                                                                                                    with_bias):
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-4, 5, (3, 7, 24), generator=gen).float()
    weights = _end_to_end((16, 8, 8), 24, gen)
    biases = [b.view(-1) for b in _end_to_end((16, 8, 8), 1, gen)] if with_bias else [None] * 3
    want = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)
    calls, linear = [], F.linear
    monkeypatch.setattr(skinny.F, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    got = skinny.linear_packed(x, weights, biases)
    assert calls == [torch.Size([32, 24])] and torch.equal(got, want) and got.is_contiguous()
    calls.clear()  # not end to end (another order, or copies): one product each, still side by side
    apart = [w.clone() for w in weights]
    got = skinny.linear_packed(x, apart, biases)
    assert len(calls) == 3 and torch.equal(got, want)
    got = skinny.linear_packed(x, [weights[1], weights[0]], [biases[1], biases[0]])
    assert torch.equal(got, torch.cat([want[..., 16:24], want[..., :16]], dim=-1))
    with pytest.raises(ValueError, match="one bias"):
        skinny.linear_packed(x, weights, biases[:2])


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_pass_slices_one_product_of_end_to_end_weights(with_bias):
    inputs = _kv_inputs(5)
    for apart, packed in ((False, 1), (True, 0)):
        module = PackedQKV(apart=apart, with_bias=with_bias).eval()
        gm = traced(module, *inputs)
        assert group_linears(gm.graph) == 1
        gm.graph.lint()
        gm.recompile()
        # one product sliced three ways where the weights lie end to end, else the grouped op
        assert count(gm, PACKED) == packed and count(gm, GROUP) == 1 - packed and count(gm, LINEAR) == 0
        assert count(gm, torch.ops.aten.slice.Tensor) >= 3 * packed
        got_cache, want_cache = _kv_inputs(5), _kv_inputs(5)
        with torch.no_grad():
            got = gm(params_of(module), *got_cache)
            want = module(*want_cache)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert torch.equal(got_cache[1], want_cache[1]) and torch.equal(got_cache[2], want_cache[2])
        assert want_cache[2].abs().sum() > 0  # the KV write happened


@pytest.mark.slow  # inductor's compile: several seconds on a 2-core CPU
def test_inductor_runs_a_packed_group_as_views_and_the_kv_write_gets_its_values():
    module = PackedQKV(with_bias=True).eval()
    compiled = torch.compile(module, fullgraph=True, options={"post_grad_custom_pre_pass": GroupLinears()})
    compiled_codes = 0
    for rows in (5, 9):
        got_inputs, want_inputs = _kv_inputs(rows), _kv_inputs(rows)
        torch._dynamo.mark_dynamic(got_inputs[0], 0)
        torch._dynamo.mark_dynamic(got_inputs[3], 0)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            got, codes = run_and_get_code(compiled, *got_inputs)
            want = module(*want_inputs)
        compiled_codes += len(codes)
        for code in codes:
            assert code.count("= torch.ops.hf_paged.linear_packed.default(") == 1
            assert "linear_group" not in code and "hf_paged.linear.default" not in code
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # v's write is exact; k went through the compiled sin (a few ulp from eager's)
        assert torch.equal(got_inputs[2], want_inputs[2]) and want_inputs[2].abs().sum() > 0
        torch.testing.assert_close(got_inputs[1], want_inputs[1], rtol=1e-6, atol=1e-6)
    assert compiled_codes >= 1
