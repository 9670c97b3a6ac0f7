"""``hf_paged.compile._kernel_funcs``: kernel-routed modules (``kernels.use_kernelized_func``) traced without the
wrapper's ``try`` block, so that attention's graph break resumes in the decoder layer's graph.

Each test compiles one decoder layer with a graph-recording backend (no inductor) and checks both the graphs and
the values against the eager layer.
"""

from __future__ import annotations

from types import MethodType

import pytest
import torch

from hf_paged.compile import _layers as cl
from hf_paged.compile import _patches as patches
from hf_paged.compile._kernel_funcs import is_kernel_router, route_around
from tiny_models import make_models

NESTED = "nested_graph_breaks" in torch._dynamo.config._config


def _layer_inputs(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=gen)
    positions = torch.arange(7)[None].expand(2, -1)
    return hidden, positions, model.model.rotary_emb(hidden, positions)


def _graphs_of(layer, hidden, positions, embeddings) -> tuple[torch.Tensor, list[list]]:
    """The layer's output compiled with nested graph breaks, and the call targets of each graph dynamo made."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(**cl.DYNAMO_DEFAULTS), torch.no_grad():
            out = torch.compile(layer, backend=record, dynamic=True)(
                hidden, attention_mask=None, position_ids=positions, position_embeddings=embeddings)
    finally:
        torch._dynamo.reset()
    return out, graphs


def _routed_model(seed: int):
    model = make_models("llama_gqa", seed=seed, num_hidden_layers=1)[1]
    layer = model.model.layers[0]
    routed = route_around([layer], "compiled_layers")
    return model, layer, routed


@pytest.mark.slow  # dynamo traces a whole layer: seconds on a 2-core CPU
@pytest.mark.skipif(not NESTED, reason="this torch's dynamo has no nested graph breaks")
def test_the_layer_after_attention_is_one_graph_with_the_eager_values():
    """Attention's break (the "hf_paged" function is opaque to the compiler) resumes in the layer's frame: two graphs,
    the second holding o_proj and the residual add after it, whether or not this transformers routes Llama's
    attention through kernels' wrapper; the layer's output equals its eager output."""
    model, layer, routed = _routed_model(seed=11)
    hidden, positions, embeddings = _layer_inputs(model, seed=12)
    with torch.no_grad():
        want = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=embeddings)
    got, graphs = _graphs_of(layer, hidden, positions, embeddings)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(graphs) == 2, graphs
    after = graphs[1]
    linear = torch._C._nn.linear
    assert after.count(linear) == 4  # o_proj, then the MLP's gate, up and down
    assert after.index(linear) < after.index(__import__("operator").add)  # o_proj before the residual add
    assert routed == [layer.self_attn] if is_kernel_router(layer.self_attn) else routed == []
    patches.restore(routed, "compiled_layers")


def test_a_kernel_routed_module_is_found_and_keeps_a_selected_kernel():
    """A module built with kernels.use_kernelized_func is found; traced with no kernel selected it calls the plain
    function; with a kernel selected (what kernelize does: the function's private module gets a forward of its own)
    the traced call goes through the wrapper and runs that kernel, as the eager call does; restore puts the class
    forward back."""
    kernels = pytest.importorskip("kernels")

    @kernels.use_kernel_forward_from_hub("HfPagedTestScale")
    def scale(x):
        return 2 * x

    @kernels.use_kernelized_func(scale)
    class Scaled(torch.nn.Module):
        def forward(self, x):
            return scale(x) + 1

    module, x = Scaled(), torch.randn(3, 4)
    assert is_kernel_router(module) and not is_kernel_router(torch.nn.Linear(2, 2))
    assert route_around([module], "compiled_layers") == [module]
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), 2 * x + 1)
    torch._dynamo.reset()

    func = next(iter(module._kernel_funcs.values()))
    func.forward = MethodType(lambda self, x: 3 * x, func)  # a selected kernel
    torch.testing.assert_close(module(x), 3 * x + 1)
    torch.testing.assert_close(torch.compile(module, backend="eager")(x), 3 * x + 1)
    torch._dynamo.reset()
    assert patches.restore([module], "compiled_layers") == 1 and "forward" not in module.__dict__
