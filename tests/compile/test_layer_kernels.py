"""The layer kernels' routing (``hf_paged.compile._layer_kernels``): which modules it routes (what they compute, not
their names), that routed calls hand the kernels the right tensors, and that every call outside the flag runs the
model's own code. The kernels themselves run on CUDA only (``tests/gpu/kernels/test_layer_ops_gpu.py``); here the
Llama references of ``hf_paged.kernels._layer_ops`` stand in for them, so a routing that passed gate for up, or cos
for sin, changes the logits."""

from __future__ import annotations

import sys

import pytest
import torch
from tiny_models import VOCAB, make_config
from transformers import AutoModelForCausalLM

from hf_paged import _forward_context
from hf_paged.compile import _layer_kernels as layer_kernels
from hf_paged.compile import _patches as patches
from hf_paged.kernels import _layer_ops as ops


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(arch), attn_implementation="eager").eval()
    for p in model.parameters():  # norms start at ones (Gemma's at zeros): give them values of their own
        if p.dim() == 1:
            p.data.normal_(1.0, 0.1)
    return model


@pytest.fixture
def stand_ins(monkeypatch):
    """The references as the kernels, on the CPU, counting their calls."""
    calls = {"rms_norm": 0, "add_rms_norm": 0, "silu_and_mul": 0, "rotary": 0}

    def counted(name, function):
        def call(*args):
            calls[name] += 1
            return function(*args)
        return call

    monkeypatch.setattr(ops, "serves", lambda *tensors: all(t.dtype == tensors[0].dtype for t in tensors))
    monkeypatch.setattr(ops, "rms_norm", counted("rms_norm", ops.rms_norm_reference))
    monkeypatch.setattr(ops, "add_rms_norm", counted("add_rms_norm", ops.add_rms_norm_reference))
    monkeypatch.setattr(ops, "silu_and_mul", counted("silu_and_mul", ops.silu_and_mul_reference))
    monkeypatch.setattr(ops, "rotary", counted("rotary", ops.rotary_reference))
    return calls


def _logits(model, ids, kernels: bool) -> torch.Tensor:
    with torch.no_grad(), _forward_context.forward_context(layer_kernels=kernels):
        return model(input_ids=ids).logits


def test_a_norm_whose_input_is_not_the_layers_sum_computes_its_own(stand_ins):
    """A layer computes the next norm's result with its last residual add; a hook that hands the next layer another
    tensor (here: the sum scaled) makes that norm compute its own, so the logits stay the model's own under the hook."""
    model = _model("llama_gqa")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    hook = model.model.layers[0].register_forward_hook(lambda module, args, out: out * 1.5)
    try:
        want = _logits(model, ids, kernels=False)
        layer_kernels.install(model)
        assert torch.equal(_logits(model, ids, kernels=True), want)
        assert stand_ins["rms_norm"] == 2  # the first layer's input norm, and the second's on the hooked output
    finally:
        hook.remove()
        layer_kernels.uninstall(model)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2", "qwen3"])
def test_routed_calls_give_the_models_own_logits(arch, stand_ins):
    model = _model(arch)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids, kernels=False)
    try:
        routed = layer_kernels.install(model)
        layers = model.config.num_hidden_layers
        norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)  # (Qwen3's q_norm and k_norm too)
        assert sum(int(r.rsplit(" x ", 1)[1]) for r in routed if "RMSNorm" in r) == norms
        assert any(r.endswith(f"MLP x {layers}") for r in routed)
        assert any(r.endswith(".apply_rotary_pos_emb x 1") for r in routed)
        assert f"q_proj+k_proj+v_proj x {layers}" in routed
        assert any(r.endswith(f"DecoderLayer x {layers}") for r in routed)
        assert torch.equal(_logits(model, ids, kernels=False), want)
        assert not any(stand_ins.values())  # no flag: the model's own code
        assert torch.equal(_logits(model, ids, kernels=True), want)
        # every norm after a residual add runs with it: the post-attention norms, the next layer's input norm and the
        # final norm; only the first layer's input norm (and Qwen3's q/k norms) on their own
        assert stand_ins == {"rms_norm": norms - 2 * layers, "add_rms_norm": 2 * layers, "silu_and_mul": layers,
                             "rotary": layers}
    finally:
        layer_kernels.uninstall(model)


def test_the_packed_gate_and_up_are_split_in_their_order(stand_ins):
    from hf_paged.compile._packed_weights import pack_siblings

    model = _model("llama_gqa")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    want = _logits(model, ids, kernels=False)
    assert pack_siblings(model) > 0
    try:
        layer_kernels.install(model)
        assert torch.equal(_logits(model, ids, kernels=True), want)
        assert stand_ins["silu_and_mul"] == model.config.num_hidden_layers
    finally:
        layer_kernels.uninstall(model)


def test_modules_that_compute_something_else_keep_their_code(stand_ins):
    model = _model("gemma")  # RMSNorm of (1 + weight), a GELU MLP; its rotary embedding is Llama's
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    want = _logits(model, ids, kernels=False)
    try:
        routed = layer_kernels.install(model)
        assert routed == ["q_proj+k_proj+v_proj x 2", "modeling_gemma.apply_rotary_pos_emb x 1"]
        assert torch.equal(_logits(model, ids, kernels=True), want)
        assert stand_ins == {"rms_norm": 0, "add_rms_norm": 0, "silu_and_mul": 0,
                             "rotary": model.config.num_hidden_layers}
    finally:
        layer_kernels.uninstall(model)
    assert layer_kernels.install(_model("gpt2")) == []  # LayerNorm (bias), no gate/up, no rotary


def test_a_decoder_layer_that_adds_otherwise_keeps_its_code(stand_ins):
    model = _model("llama_gqa")
    layer_class = type(model.model.layers[0])

    class Scaled(layer_class):  # a residual stream of its own: the layer's output doubled
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs) * 2

    for layer in model.model.layers:
        layer.__class__ = Scaled
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    want = _logits(model, ids, kernels=False)
    try:
        routed = layer_kernels.install(model)
        assert not any("DecoderLayer" in r or "Scaled" in r for r in routed) and any("RMSNorm" in r for r in routed)
        assert torch.equal(_logits(model, ids, kernels=True), want)
        assert stand_ins["add_rms_norm"] == 0 and stand_ins["rms_norm"] > 0
    finally:
        layer_kernels.uninstall(model)


def test_q_k_v_run_as_one_product_whose_views_the_calls_on_its_input_take(stand_ins):
    model = _model("llama_gqa")
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(1, 4, model.config.hidden_size, generator=g), torch.randn(1, 4, model.config.hidden_size,
                                                                                 generator=g)
    try:
        layer_kernels.install(model)
        with torch.no_grad(), _forward_context.forward_context(layer_kernels=True):
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            k_other = attn.k_proj(y)  # another input: its own product
        base = q.untyped_storage().data_ptr()
        assert k.untyped_storage().data_ptr() == base and v.untyped_storage().data_ptr() == base
        assert k_other.untyped_storage().data_ptr() != base
        for got, linear, inp in ((q, attn.q_proj, x), (k, attn.k_proj, x), (v, attn.v_proj, x),
                                 (k_other, attn.k_proj, y)):
            torch.testing.assert_close(got, torch.nn.functional.linear(inp, linear.weight, linear.bias))
        with torch.no_grad():  # no flag: each its own product
            assert attn.k_proj(x).untyped_storage().data_ptr() != attn.q_proj(x).untyped_storage().data_ptr()
    finally:
        layer_kernels.uninstall(model)


def test_uninstall_gives_every_module_and_the_rotary_function_back():
    model = _model("llama_gqa")
    family = sys.modules[type(model.model.layers[0].self_attn).__module__]
    function = family.apply_rotary_pos_emb
    layer_kernels.install(model)
    assert family.apply_rotary_pos_emb is not function
    assert patches.patched(model.modules(), "layer_kernels")
    assert len(layer_kernels.install(model)) == 5  # installing again changes nothing
    layer_kernels.uninstall(model)
    assert family.apply_rotary_pos_emb is function
    assert not patches.patched(model.modules(), "layer_kernels")


def test_a_call_the_kernel_does_not_take_runs_the_functions_own_code(stand_ins):
    model = _model("llama_gqa")
    family = sys.modules[type(model.model.layers[0].self_attn).__module__]
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 3, 4, 16, generator=g), torch.randn(1, 3, 2, 16, generator=g)  # [batch, tokens, heads, d]
    cos, sin = torch.randn(1, 3, 16, generator=g), torch.randn(1, 3, 16, generator=g)
    want = [t.transpose(1, 2) for t in ops.rotary_reference(q.transpose(1, 2), k.transpose(1, 2), cos, sin)]
    try:
        layer_kernels.install(model)
        with _forward_context.forward_context(layer_kernels=True):
            got = family.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        assert stand_ins["rotary"] == 0  # an argument the kernel does not take: the function itself ran
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        layer_kernels.uninstall(model)


def test_the_engine_setting_says_why_it_cannot_serve():
    model = _model("llama_gqa")
    assert layer_kernels.for_engine(model, False) is False
    with pytest.raises(ValueError, match="cannot be served: the model is on cpu.*layer_kernels=False"):
        layer_kernels.for_engine(model, True)
    with pytest.raises(ValueError, match="tensor parallel"):
        layer_kernels.for_engine(model, True, "the model is tensor parallel")
    assert not patches.patched(model.modules(), "layer_kernels")


def test_an_engines_eager_steps_run_on_the_layer_kernels_when_asked(stand_ins, monkeypatch):
    """The engine's wiring, on the CPU: ``layer_kernels=True`` routes the model (the CUDA check stood in for), its
    steps set the flag, and the tokens are those of an engine without them; the model's own calls stay unrouted."""
    import hf_paged
    from engine_helpers import models, random_prompts
    from transformers import GenerationConfig

    monkeypatch.setattr(layer_kernels, "_unsupported_reason", lambda model: None)
    _, model = models("llama_gqa")
    prompts = random_prompts(3, 4, 12, seed=7)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    runs = {}
    try:
        for kernels in (False, True):
            engine = hf_paged.Engine(model, num_blocks=32, block_size=4, layer_kernels=kernels)
            runs[kernels] = [out.token_ids for out in engine.generate(prompts, config)]
            assert engine.stats()["layer_kernels"] is kernels
            engine.close()
            if not kernels:
                assert not any(stand_ins.values())
        assert runs[True] == runs[False]
        layers = model.config.num_hidden_layers
        assert stand_ins["add_rms_norm"] > 0 and stand_ins["add_rms_norm"] % layers == 0
        assert stand_ins["rotary"] == stand_ins["silu_and_mul"] == stand_ins["add_rms_norm"] // 2
        before = dict(stand_ins)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompts[0]]))  # not an engine call: the model's own code
        assert stand_ins == before
    finally:
        layer_kernels.uninstall(model)


@pytest.mark.parametrize("arch, served", [("llama_gqa", True), ("gemma", False)])
def test_the_automatic_setting_serves_where_the_bulk_is_routed_and_then_leaves_the_layers_eager(
        arch, served, stand_ins, monkeypatch):
    """No settings: where the kernels route the model's norms, MLPs and rotary embedding, the engine's steps run on
    them and its layers are not compiled; a Gemma (its RMSNorm adds one to the weight, its MLP is GELU) gets none of
    its modules routed and the automatic compile decides as it would without the kernels."""
    import hf_paged
    from engine_helpers import models, random_prompts
    from hf_paged.compile import _layers as compiled_layers
    from transformers import GenerationConfig

    monkeypatch.setattr(layer_kernels, "_unsupported_reason", lambda model: None)
    asked = []
    monkeypatch.setattr(compiled_layers, "for_engine", lambda model, setting, how=None: asked.append(setting))
    _, model = models(arch)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    try:
        engine = hf_paged.Engine(model, num_blocks=32, block_size=4)
        engine.generate(random_prompts(2, 4, 8, seed=3), config)
        assert engine.stats()["layer_kernels"] is served and engine.stats()["compiled_layers"] is False
        engine.close()
        assert asked == [False if served else None]
        assert (stand_ins["add_rms_norm"] > 0) is served and (stand_ins["rotary"] > 0) is served
        assert any(patches.patch_of(m, "layer_kernels") for m in model.modules()) is served
    finally:
        layer_kernels.uninstall(model)
