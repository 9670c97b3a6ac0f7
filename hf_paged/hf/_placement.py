"""Where a transformers model keeps its decoder layers, and on which device each runs (accelerate's device maps).

One answer for every part of the project that asks: the engine (KV placement, compiled layers), the cache for a
mapped model (``hf_paged.integrations.accelerate.paged_cache_for``) and the data-parallel helpers.
"""

from __future__ import annotations

import re

import torch

from hf_paged import _compat
from hf_paged.cache._kv_pool import KVLayout


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under its head (``model.model`` for a Llama), or the model itself when it names none."""
    prefix = getattr(model, "base_model_prefix", "")
    return getattr(model, prefix, model) if prefix else model


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers: the ``ModuleList`` child of its base model with one entry per hidden
    layer, else a ``ModuleList`` of that length named ``...layers`` or ``...h`` anywhere in it; None if neither."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if config is not None else None
    num_layers = getattr(text_config, "num_hidden_layers", None)
    fits = lambda m: isinstance(m, torch.nn.ModuleList) and len(m) > 0 and num_layers in (None, len(m))  # noqa: E731
    return (next((m for m in base_model(model).children() if fits(m)), None)  # (a list that fits is not empty)
            or next((m for name, m in model.named_modules() if fits(m) and re.search(r"(layers|h)$", name)), None))


def layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of each decoder layer, in layer order.

    Uses ``model.hf_device_map`` when present (the longest module-path prefix that names a layer wins), else the
    device of each layer's parameters.
    """
    if (layers := decoder_layers(model)) is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return [next(layer.parameters()).device for layer in layers]
    names = {id(module): name for name, module in model.named_modules()}
    devices = []
    for layer in layers:
        name = names[id(layer)]
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len, default=None)
        if owner is None:
            raise ValueError(f"hf_device_map does not place {name}; load the model with a complete device_map")
        if (where := device_map[owner]) == "disk":
            raise ValueError("layers offloaded to disk cannot hold a KV cache; give them a GPU or the CPU")
        devices.append(torch.device("cuda", where) if isinstance(where, int) else torch.device(where))
    return devices


def kv_devices(model: torch.nn.Module) -> list[torch.device]:
    """Where each layer's KV goes: its layer's device, or the model's device for every layer when the model has no
    list of layers to place (a stub). Raises for a layer the map leaves out or puts on disk."""
    num_layers = KVLayout.from_config(model.config).num_layers
    devices = layer_devices(model) if decoder_layers(model) is not None else []
    return devices if len(devices) == num_layers else [model.device] * num_layers


def hidden_states_device(model: torch.nn.Module) -> torch.device:
    """Where the base model's output lands under a device map: the device of its last child with parameters
    (the final norm)."""
    last = [m for m in base_model(model).children() if next(m.parameters(), None) is not None][-1]
    return next(last.parameters()).device


def keep_argument_in_place(model: torch.nn.Module, name: str) -> None:
    """Tell accelerate's hook on a dispatched model (which moves every tensor argument to the first device) to leave
    the keyword argument ``name`` where the caller put it."""
    hook = _compat.accelerate_hook(model)
    if hook is None or not hasattr(hook, "skip_keys"):
        return
    keys = hook.skip_keys
    keys = [] if keys is None else [keys] if isinstance(keys, str) else list(keys)
    if name not in keys:
        hook.skip_keys = [*keys, name]

