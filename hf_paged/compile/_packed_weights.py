"""Sibling weights laid end to end: the linears of a layer that read one input (q/k/v, gate/up) get their weights
moved into one buffer, so that the grouped-linears pass (``hf_paged.compile._group_linears``) runs them as one matrix
product where the skinny kernel does not serve them (more than 8 rows: prefill chunks and decode batches above 8).

On the anchor (Llama-3.2-1B shape, decode at batch 256 on an H200) q, k and v were three cuBLAS launches per layer,
k and v of 512 outputs each taking as long as a launch's floor; gate and up two launches of 8192 outputs.

What moves is each parameter's storage: the ``Parameter`` objects, their shapes, strides, dtypes and values stay, so
the user's references, ``state_dict`` and optimizer keep working; ``save_pretrained`` saves the weights as before
(transformers clones tensors that share a storage without overlapping). Only plain tensors are packed: a quantized
or offloaded (meta) weight, a tensor-parallel shard (``hf_paged.parallel._linears`` packs those itself) or weights
of differing dtype, device or input size are left where they are, and so is a group whose move finds no device
memory for its second copy (the engine's KV pool is allocated first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hf_paged.kernels import _skinny as skinny

logger = logging.getLogger("hf_paged")

#: Linears of one module that read the same input, in the order their weights are laid out.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def pack_siblings(model: torch.nn.Module, groups: tuple[tuple[str, ...], ...] = SIBLINGS,
                  movable: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> int:
    """Lay out each group of ``groups`` (the names of linears of one module that read one input; :data:`SIBLINGS`
    unless given) among ``model``'s modules end to end in one buffer (weights in one, biases in another).
    ``movable`` gives the tensor that moves for a weight or bias, None where none can (by default the parameter
    itself where it is a plain tensor; a tensor-parallel shard's local tensor: ``hf_paged.parallel._linears``).
    Returns how many groups are packed now (those packed before included)."""
    packed = 0
    for parent in model.modules():
        for names in groups:
            group = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, torch.nn.Linear) for m in group) and _pack_linears(group, movable or _plain):
                packed += 1
    return packed


def move_end_to_end(tensors: list[torch.Tensor]) -> None:
    """Give ``tensors`` (contiguous, one dtype and device) one new storage in which they lie end to end, their values
    kept; the old storages are freed where nothing else holds them."""
    with torch.no_grad():
        buffer = torch.cat([t.reshape(-1) for t in tensors])
        offset = 0
        for t in tensors:
            t.set_(buffer.untyped_storage(), offset, t.shape, t.stride())
            offset += t.numel()


def _pack_linears(group: list[torch.nn.Linear], movable: Callable) -> bool:
    """Move the group's weights (and biases, unless all None) into one buffer each, end to end, unless they lie so
    already; False (nothing moved) unless each moves (``movable``), they are contiguous, of one dtype and device, and
    the weights 2-d with one input size."""
    weights = [movable(m.weight) for m in group]
    biases = [None if m.bias is None else movable(m.bias) for m in group]
    if any(t is None for t in weights) or (any(m.bias is not None for m in group) and any(b is None for b in biases)):
        return False
    first, tensors = weights[0], weights + [b for b in biases if b is not None]
    if any(not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device for t in tensors):
        return False
    if any(w.dim() != 2 or w.shape[1] != first.shape[1] for w in weights):
        return False
    if skinny.packed_rows(weights, biases) is not None:  # an earlier compile or engine packed them
        return True
    try:  # the move holds a second copy of the group for a moment: the KV pool may have left no room
        move_end_to_end(weights)
        if biases[0] is not None:
            move_end_to_end(biases)
    except torch.OutOfMemoryError:
        logger.info("hf_paged: no room to lay %s end to end; they stay apart (one product each)",
                    ", ".join(type(m).__name__ for m in group))
        return False
    return True


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` where it is a dense tensor of its own (no subclass, no meta, nothing that stands for a weight kept
    elsewhere), else None."""
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    plain = (type(data) is torch.Tensor and data.device.type != "meta" and data.layout is torch.strided
             and data.is_contiguous() and data.is_floating_point())
    return t if plain else None
