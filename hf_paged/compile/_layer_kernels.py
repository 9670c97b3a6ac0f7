"""Route a model's norms, residual adds, MLPs, q/k/v and rotary embedding to hf_paged's layer kernels, for eager layers.

A decoder layer that runs without ``torch.compile`` runs transformers' modules operator by operator: RMSNorm as six
kernels, the rotary embedding as about ten per tensor, SiLU x up as two, each a launch and a pass over memory
(Llama-3.2-1B, one decode step at batch 1 on an H100: 666 kernels and 2.50 ms, against 221 and 1.42 ms compiled).
:func:`install` gives five kinds of the model's code a replacement that, inside hf_paged's own model calls whose
layers run eagerly (``hf_paged._forward_context.layer_kernels``), runs one launch where they take several, and the
code's own forward everywhere else:

- each RMSNorm module (a ``weight`` and an ``eps`` or ``variance_epsilon``, no children): ``rms_norm``;
- each pre-norm decoder layer (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``) whose
  post-attention norm is routed: the residual add after attention and that norm as one ``add_rms_norm``, and its
  last residual add with the norm after the layer (the next layer's input norm, or the final one) as another, whose
  result that norm's call on the sum takes;
- each MLP of ``gate_proj``, ``up_proj`` and ``down_proj`` linears: the gate and up products as one where their
  weights lie end to end (:func:`install` lays them so: ``hf_paged.compile._packed_weights``; through the skinny
  kernel where the call routes the linears), ``silu_and_mul`` on the two halves, then ``down_proj``;
- each attention's ``q_proj``, ``k_proj`` and ``v_proj`` whose weights lie end to end: the first call computes the
  three products as one and hands the keys and values to the two calls that follow on the same input tensor (views
  of the one product, no kernel); a call on another input computes its own;
- the ``apply_rotary_pos_emb`` function of the attention modules' modeling module: ``rotary`` for queries and keys
  (a replacement of the module's global, so every model of that family in the process goes through it; outside
  hf_paged's own calls it is the function itself).

What decides is what the code computes, not its name: before a class (or function) is routed, its own forward runs
on a random input beside the Llama-family reference of ``hf_paged.kernels._layer_ops`` (the same operators), and
only a bit-identical result routes it (a decoder layer's probe stands simple functions in for its attention and MLP,
so that only the layer's own adds and norms are compared). A Gemma RMSNorm (``1 + weight``), a GELU MLP or a partial
rotary embedding keeps its code; a call the kernels do not take (another dtype, a CPU tensor, extra arguments) runs
the code too.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from hf_paged import _forward_context
from hf_paged.compile import _patches as patches
from hf_paged.compile._packed_weights import pack_siblings
from hf_paged.hf._placement import base_model, decoder_layers
from hf_paged.kernels import _layer_ops as ops
from hf_paged.kernels import _skinny as skinny
from hf_paged.kernels._build import ensure_loaded

logger = logging.getLogger("hf_paged")

_KIND = "layer_kernels"
_ROPE = "apply_rotary_pos_emb"
_MLP = ("gate_proj", "up_proj", "down_proj")
_QKV = ("q_proj", "k_proj", "v_proj")


def for_engine(model: torch.nn.Module, setting: bool | None, reason: str | None = None) -> bool:
    """Whether the engine's eager model calls run the layer kernels per ``Engine(layer_kernels=...)``, installing the
    routing where they do. None (automatic): where they serve the model and route its norms, MLPs and rotary
    embedding (the bulk of a layer's work outside its products and attention); True: wherever they route anything,
    else ``ValueError`` saying why. ``reason``: why the engine cannot use them whatever the model (a tensor-parallel
    model's layers)."""
    if setting is False:
        return False
    reason = reason or _unsupported_reason(model)
    routed = install(model) if reason is None else []
    if reason is None and not routed:
        reason = "no RMSNorm, MLP or rotary embedding of the model computes what the kernels do"
    if setting is None and reason is None and not _routes_the_bulk(model):
        reason = f"they route only {', '.join(routed)}"
        uninstall(model)
    if reason is not None:
        if setting is None:
            logger.info("hf_paged: the layer kernels leave the model's layers alone: %s", reason)
            return False
        raise ValueError(f"layer_kernels=True cannot be served: {reason}; pass layer_kernels=False")
    return True


def _routes_the_bulk(model: torch.nn.Module) -> bool:
    """Whether the model's norms, MLPs and rotary function are routed (one of each at least)."""
    modules = list(base_model(model).modules())
    return (any(_is_norm(m) and patches.patch_of(m, _KIND) is not None for m in modules)
            and any(_has_linears(m, _MLP) and patches.patch_of(m, _KIND) is not None for m in modules)
            and any(patches.patch_of(f, _KIND) is not None for f in _families(decoder_layers(model))))


def _families(layers: torch.nn.Module | None) -> set:
    """The modeling modules of the attention modules among ``layers``."""
    return {f for f in (sys.modules.get(type(m).__module__) for m in (layers.modules() if layers is not None else ())
                        if hasattr(m, "q_proj")) if f is not None}


def _unsupported_reason(model: torch.nn.Module) -> str | None:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"the model is on {', '.join(sorted(map(str, devices)))}; the layer kernels serve one CUDA device"
    if decoder_layers(model) is None:
        return f"{type(model).__name__} has no list of decoder layers"
    failure = ensure_loaded()
    return None if failure is None else f"the CUDA kernels are unavailable ({failure})"


def install(model: torch.nn.Module) -> list[str]:
    """Route ``model``'s modules and its family's rotary function that compute what the kernels do (see the module
    docstring); returns what is routed, as ``"<class or function> x <count>"`` (installing twice changes nothing)."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to route to the layer kernels")
    pack_siblings(model)  # gate/up and q/k/v in one product each
    verdicts: dict[type, bool] = {}  # a class's forward computes the reference's (asked of its first instance)

    def computes_reference(module: torch.nn.Module, probe: Callable = _computes_reference) -> bool:
        if type(module) not in verdicts:
            verdicts[type(module)] = patches.patch_of(module, _KIND) is not None or probe(module)
        return verdicts[type(module)]

    routed: Counter[str] = Counter()
    following = {layer: norm for layer, norm in _following_norms(model, layers).items() if computes_reference(norm)}
    for module in base_model(model).modules():
        if _has_linears(module, _QKV) and (patches.patch_of(module.q_proj, _KIND) is not None or _packed(module, _QKV)):
            _route_siblings(module, _QKV)
            routed["+".join(_QKV)] += 1
        if _is_layer(module):  # (routed where its norm after attention is)
            if not computes_reference(module.post_attention_layernorm):
                continue
            route, probe = partial(_layer_route, following=following.get(module)), _layer_computes_reference
        elif _is_norm(module) or _has_linears(module, _MLP):
            route, probe = (_norm_route if _is_norm(module) else _mlp_route), _computes_reference
        else:
            continue
        if computes_reference(module, probe):
            patches.install(module, _KIND, lambda eager, module=module, route=route: route(module, eager))
            routed[type(module).__name__] += 1
    for family in _families(layers):
        if callable(getattr(family, _ROPE, None)) and (
                patches.patch_of(family, _KIND) is not None or _rope_computes_reference(getattr(family, _ROPE))):
            patches.install(family, _KIND, _rope_route, attribute=_ROPE)
            routed[f"{family.__name__.rsplit('.', 1)[-1]}.{_ROPE}"] = 1
    return [f"{name} x {count}" for name, count in routed.items()]


def uninstall(model: torch.nn.Module) -> None:
    """Give every module and function :func:`install` routed its own code back."""
    patches.restore([*model.modules(), *_families(decoder_layers(model))], _KIND)


def _eps(module: torch.nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and _eps(module) is not None
            and not any(True for _ in module.children()) and getattr(module, "bias", None) is None)


def _has_linears(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return all(type(getattr(module, name, None)) is torch.nn.Linear for name in names)


def _is_layer(module: torch.nn.Module) -> bool:
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    parts = [getattr(module, name, None) for name in names]
    return all(isinstance(p, torch.nn.Module) for p in parts) and _is_norm(parts[2]) and _is_norm(parts[3])


def _following_norms(model: torch.nn.Module, layers: torch.nn.ModuleList) -> dict:
    """Each decoder layer's next norm: the next layer's ``input_layernorm``, and the base model's ``norm`` after the
    last (a layer's last residual add and that norm run as one ``add_rms_norm`` where both are routed)."""
    norms = [getattr(layer, "input_layernorm", None) for layer in list(layers)[1:]]
    norms.append(getattr(base_model(model), "norm", None))
    return {layer: norm for layer, norm in zip(layers, norms) if isinstance(norm, torch.nn.Module) and _is_norm(norm)}


def _layer_computes_reference(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer adds and norms as Llama's does: its forward, with simple functions standing in for its
    attention and MLP, equals the reference's bit for bit on a random input on its device."""
    stand_ins = {layer.self_attn: lambda *args, **kwargs: ((kwargs.get("hidden_states", args[0] if args else None)
                                                            * 0.5 + 0.25), None),
                 layer.mlp: lambda x: x * 2 - 1}
    weight = layer.post_attention_layernorm.weight
    h = _random((1, 3, weight.shape[0]), weight)

    def probe():
        before = {m: m.__dict__.get("forward") for m in stand_ins}
        try:
            for module, stand_in in stand_ins.items():
                object.__setattr__(module, "forward", stand_in)
            mid = h + layer.self_attn(hidden_states=layer.input_layernorm(h))[0]
            return layer.forward(h), mid + layer.mlp(layer.post_attention_layernorm(mid))
        finally:
            for module, forward in before.items():
                if forward is None:
                    module.__dict__.pop("forward", None)
                else:
                    object.__setattr__(module, "forward", forward)

    return _same(type(layer).__name__, probe)


def _packed(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The one weight (and bias) of ``module``'s linears ``names`` where they lie end to end, else None."""
    linears = [getattr(module, name) for name in names]
    return skinny.packed_rows([m.weight for m in linears], [m.bias for m in linears])


def _product(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """``x`` times a packed weight: where the call routes the linears, on the skinny kernel wherever it serves the
    rows (as the compiled layers' grouped products: at a few rows the launches, not the bytes, decide), else
    ``F.linear``."""
    if _forward_context.skinny_linears():
        return skinny.linear_group(x, [packed[0]], [packed[1]])[0]
    return F.linear(x, *packed)


def _computes_reference(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward gives the reference's result, bit for bit, on a random input on its device."""
    if _is_norm(module):
        x = _random((3, module.weight.shape[0]), module.weight)
        return _same(type(module).__name__, lambda: (module.forward(x),
                                                     ops.rms_norm_reference(x, module.weight, _eps(module))))
    gate, up, down = (getattr(module, name) for name in _MLP)
    x = _random((3, gate.in_features), gate.weight)
    return _same(type(module).__name__, lambda: (module.forward(x), down(ops.silu_and_mul_reference(
        F.linear(x, gate.weight, gate.bias), F.linear(x, up.weight, up.bias)))))


def _rope_computes_reference(function: Callable) -> bool:
    """Whether a rotary function gives the reference's result, bit for bit, on random float32 CPU tensors."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    return _same(getattr(function, "__qualname__", str(function)),
                 lambda: (function(q, k, cos, sin), ops.rotary_reference(q, k, cos, sin)))


def _same(name: str, probe: Callable[[], tuple]) -> bool:
    """Whether ``probe()``'s pair (the code's own result, the reference's: tensors, or tuples of them) is equal bit for
    bit; code that does not take the probe (it raises) keeps its code too. Either way, the log says why not."""
    try:
        with torch.no_grad():
            got, want = probe()
            pairs = zip(*((t,) if isinstance(t, torch.Tensor) else t for t in (got, want)), strict=True)
            same = all(torch.equal(a, b) for a, b in pairs)
    except Exception as exc:  # noqa: BLE001 - anything the probe raises means: not routed
        logger.debug("hf_paged: layer kernels leave %s alone: %s", name, exc)
        return False
    if not same:
        logger.debug("hf_paged: layer kernels leave %s alone: it computes something else", name)
    return same


def _random(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator(like.device).manual_seed(0)
    return torch.randn(shape, generator=g, device=like.device, dtype=torch.float32).to(like.dtype)


# A norm's result that the layer before it computed with its last residual add (add_rms_norm), for the norm's call on
# that sum: {norm module: (the sum, the normed sum)}, taken by that call (or dropped by the norm's next one).
_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The routed forwards are closures, not objects: dynamo guards on the identity of a callable object found on a
# module, so compiled layers (which trace these with the flag off) would each trace a graph of their own.
def _norm_route(module: torch.nn.Module, eager: Callable) -> Callable:
    eps = _eps(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not (_forward_context.layer_kernels() and ops.serves(x, module.weight)):
            return eager(x)  # (all that compiled layers trace: the flag is off in them)
        held = _held.pop(module, None)
        return held[1] if held is not None and held[0] is x else ops.rms_norm(x, module.weight, eps)

    return forward


def _layer_route(layer: torch.nn.Module, eager: Callable, following: torch.nn.Module | None) -> Callable:
    """The layer's residual add after attention and its post-attention norm as one ``add_rms_norm``; its last residual
    add too, with ``following`` (the routed norm after the layer, or None: its result held for its call)."""
    post = layer.post_attention_layernorm
    eps = _eps(post)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or not (_forward_context.layer_kernels() and ops.serves(hidden_states, post.weight)):
            return eager(hidden_states, *args, **kwargs)
        attn = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)[0]
        hidden_states, normed = ops.add_rms_norm(attn, hidden_states, post.weight, eps)
        out = layer.mlp(normed)
        if following is None or not ops.serves(out, following.weight):
            return hidden_states + out
        hidden_states, normed = ops.add_rms_norm(out, hidden_states, following.weight, _eps(following))
        _held[following] = (hidden_states, normed)
        return hidden_states

    return forward


def _mlp_route(module: torch.nn.Module, eager: Callable) -> Callable:
    gate, up, down = (getattr(module, name) for name in _MLP)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not (_forward_context.layer_kernels() and ops.serves(x, gate.weight, up.weight)):
            return eager(x)
        packed = _packed(module, _MLP[:2])
        if packed is None:
            return down(ops.silu_and_mul(gate(x), up(x)))
        return down(ops.silu_and_mul(*_product(x, packed).split(gate.out_features, dim=-1)))

    return forward


def _route_siblings(parent: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Route ``parent``'s linears ``names`` (weights end to end): the first computes every product as one and holds
    the others' outputs for their calls on the same input tensor; each later one takes its own (the tensor is held
    until the last is taken, so its identity cannot be reused meanwhile)."""
    linears = [getattr(parent, name) for name in names]
    held: dict = {}  # "input": the first's input; name: that linear's output, until taken

    def first(eager: Callable) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not (_forward_context.layer_kernels() and ops.serves(x, linears[0].weight)):
                return eager(x)
            held.clear()
            packed = _packed(parent, names)
            if packed is None:  # (weights replaced since install)
                return eager(x)
            outs = _product(x, packed).split([m.out_features for m in linears], dim=-1)
            held.update(zip(names[1:], outs[1:]), input=x)
            return outs[0]

        return forward

    def later(name: str, eager: Callable) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if held and held.get("input") is x and name in held:
                out = held.pop(name)
                if len(held) == 1:
                    held.clear()
                return out
            return eager(x)

        return forward

    patches.install(linears[0], _KIND, first)
    for name, linear in zip(names[1:], linears[1:]):
        patches.install(linear, _KIND, lambda eager, name=name: later(name, eager))


def _rope_route(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _forward_context.layer_kernels() and not args and not kwargs and _rope_fits(q, k, cos, sin):
            return ops.rotary(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes a call: ``[batch, heads, tokens, head_dim]`` queries and keys with the whole (even)
    head_dim rotated by ``[batch or 1, tokens, head_dim]`` cos and sin, in one dtype on CUDA."""
    return (ops.serves(q, k, cos, sin) and q.dim() == k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0]) and q.shape[2:] == k.shape[2:]
            and cos.shape[1:] == q.shape[2:] and q.shape[-1] % 2 == 0)
