"""Route a model's linear layers through the skinny decode kernel (``hf_paged.kernels._skinny``), only when asked.

:func:`install` gives every plain ``nn.Linear`` of the decoder layers and the output head a per-instance forward
that calls :func:`hf_paged.kernels._skinny.linear` inside a model call whose forward context routes the linears
(``hf_paged._forward_context``: the engine's calls, when its ``skinny_linear`` setting is on), or where
:func:`route_always` switched the module on, and the module's own forward otherwise: elsewhere the model computes
exactly what it did before, and a module that no caller asks for costs two flag tests per call. The flag is a
plain attribute read in Python, so a ``torch.compile``'d forward guards on it and holds the skinny op only in graphs
traced inside a routing call. The op itself picks the kernel or ``F.linear`` per call (row count, device, dtype), so
routing a prefill step is safe, only useless.

Modules whose weights the kernel could not stream are left alone: subclasses of ``nn.Linear`` (quantized or
otherwise special), weights that are tensor subclasses (quantized parameters, DTensors), on the meta device,
non-contiguous, of a dtype the kernel does not serve or other than the rest of the layers', or with K not a
multiple of 8.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from hf_paged import _forward_context
from hf_paged.compile import _patches as patches
from hf_paged.hf._placement import decoder_layers
from hf_paged.kernels import _skinny as skinny
from hf_paged.kernels._build import ensure_loaded

logger = logging.getLogger("hf_paged")

_ALWAYS = "_hf_paged_skinny_always"  # a patched module's own switch: served by the op outside active() too


def for_engine(model: torch.nn.Module, setting: bool | None, option: str = "skinny_linear",
               routed_elsewhere: int = 0) -> bool:
    """Whether the engine's model calls route the linears through the skinny op per ``Engine(skinny_linear=...)``
    (installing the routing when they do): None (automatic) where the model is on CUDA in float16/bfloat16 and the
    kernels load, True the same or an error saying why not, False never. ``option`` names the setting in that error
    (``hf_paged.optimize_generate`` asks the same with its ``decode_linears``); ``routed_elsewhere``: linears that
    another patcher routes through the op (a tensor-parallel model's local shards, which :func:`install` passes
    over)."""
    if setting is False:
        return False
    reason = _unsupported_reason(model)
    if reason is None and not install(model) and not routed_elsewhere:
        reason = "no linear layer of the model can be served (see the debug log)"
    if reason is not None:
        if setting:
            raise ValueError(f"{option}=True cannot be served: {reason}; pass {option}=False")
        logger.info("hf_paged: decode steps keep torch's linear layers: %s", reason)
        return False
    return True


def _unsupported_reason(model: torch.nn.Module) -> str | None:
    device = getattr(model, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return f"the model is on {device}, the skinny kernel runs on CUDA GPUs"
    if getattr(model, "dtype", None) not in skinny.DTYPES:
        return f"the model is in {getattr(model, 'dtype', None)}, the skinny kernel serves {skinny.DTYPES}"
    if decoder_layers(model) is None:
        return f"{type(model).__name__} has no list of decoder layers"
    if (failure := ensure_loaded()) is not None:
        return f"the CUDA kernels are unavailable ({failure})"
    return None


def install(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Patch the eligible ``nn.Linear`` modules of ``model``'s decoder layers and output head (see the module's
    docstring); returns every patched module, those patched by an earlier call included (installing twice changes
    nothing).

    Raises:
        ValueError: the model has no list of decoder layers.
    """
    if (layers := decoder_layers(model)) is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to route through the skinny linear")
    candidates = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear) and all(head is not m for m in candidates):
        candidates.append(head)
    counts = Counter(p.dtype for p in layers.parameters() if p.is_floating_point())
    dtype = counts.most_common(1)[0][0] if counts else None  # the layers' most common floating dtype (by count)
    patched = []
    for module in candidates:
        if patches.patch_of(module, "skinny_linears") is None:
            reason = (f"a subclass of nn.Linear ({type(module).__name__})" if type(module) is not torch.nn.Linear
                      else skip_reason(module.weight, module.bias, dtype))
            if reason is not None:
                logger.debug("hf_paged: skinny linear leaves %s alone: %s", type(module).__name__, reason)
                continue
            _patch(module)
        patched.append(module)
    return patched


def route_always(modules: list[torch.nn.Linear], always: bool) -> None:
    """Serve the patched ``modules`` through the skinny op on every call (``always=True``: a compiled ``generate``
    step, which runs outside hf_paged's own model calls; see ``hf_paged.optimize_generate``), or again only inside
    routing calls."""
    for module in modules:
        if patches.patch_of(module, "skinny_linears") is None:
            raise ValueError(f"{type(module).__name__} was not patched by skinny_linear.install")
        object.__setattr__(module, _ALWAYS, always)


def uninstall(model: torch.nn.Module) -> None:
    """Give every module :func:`install` patched its previous forward back."""
    for module in model.modules():
        if patches.restore([module], "skinny_linears"):
            module.__dict__.pop(_ALWAYS, None)


def skip_reason(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None) -> str | None:
    """None if a linear of this weight and bias (a plain ``nn.Linear``'s, or a tensor-parallel shard's local tensors:
    ``hf_paged.parallel._linears``) can be routed through the skinny op (``dtype``: the layers' dtype), else why
    not."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and type(t) not in (torch.nn.Parameter, torch.Tensor):
            return f"its {name} is a {type(t).__name__}"
    if weight.is_meta:
        return "its weight is on the meta device"
    if weight.dtype not in skinny.DTYPES:
        return f"the kernel serves {skinny.DTYPES}, the weight is {weight.dtype}"
    if weight.dtype != dtype or (bias is not None and bias.dtype != weight.dtype):
        return f"its dtype {weight.dtype} differs from the layers' {dtype}"
    if not weight.is_contiguous():
        return "its weight is not contiguous"
    if weight.shape[1] % 8:
        return f"in_features {weight.shape[1]} is not a multiple of 8"
    return None


def _patch(module: torch.nn.Linear) -> None:
    def routed(eager):  # an instance forward set by someone else (a hook) is kept and called
        def forward(input: torch.Tensor) -> torch.Tensor:
            if _forward_context.skinny_linears() or getattr(module, _ALWAYS):
                return skinny.linear(input, module.weight, module.bias)
            return eager(input)

        return forward

    object.__setattr__(module, _ALWAYS, False)
    patches.install(module, "skinny_linears", routed)
