"""accelerate ``device_map`` support: put each layer's KV blocks on the device that runs that layer.

A model loaded with ``device_map="auto"`` (or any map) records where each module went in ``model.hf_device_map``.
``paged_cache_for`` reads it and builds a :class:`hf_paged.PagedAttentionCache` whose per-layer K/V tensors sit next
to their layer's weights; the step metadata then reaches each device once per step (``PagedMetadata.on``).
"""

from __future__ import annotations

import re

import torch

import hf_paged


def layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of each decoder layer's attention, in layer order.

    Uses ``model.hf_device_map`` when present (the longest module-path prefix that names a layer wins), else the
    device of each layer's parameters.
    """
    layers = _decoder_layers(model)
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
        devices.append(_as_device(device_map[owner]))
    return devices


def paged_cache_for(model: torch.nn.Module, **kwargs) -> hf_paged.PagedAttentionCache:
    """A ``PagedAttentionCache`` for ``model`` with each layer's KV on that layer's device (``kwargs`` as for
    ``PagedAttentionCache``: ``num_blocks`` or ``memory_budget``, ``block_size``, ``backend``)."""
    if "device" in kwargs:
        raise ValueError("paged_cache_for places the KV by the model's device map; do not pass device=")
    kwargs.setdefault("dtype", model.dtype)
    return hf_paged.PagedAttentionCache(model.config, device=layer_devices(model), **kwargs)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers and re.search(r"(layers|h)$", name):
            return list(module)
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def _as_device(where) -> torch.device:
    if isinstance(where, int):
        return torch.device("cuda", where)
    if where == "disk":
        raise ValueError("layers offloaded to disk cannot hold a KV cache; give them a GPU or the CPU")
    return torch.device(where)
