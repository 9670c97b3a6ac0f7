"""The one registry of the replacements hf_paged puts on a model's modules (their ``forward``, or another attribute).

hf_paged changes a model's behaviour in seven ways, each by giving modules a ``forward`` of their own: the compiled
layers (``compile._layers``), the skinny linear routing (``compile._skinny_linears``), the layer kernels' routing
(``compile._layer_kernels``, which also replaces a modeling module's rotary function), a tensor-parallel model's local
products (``parallel._linears``) and its local logits (``parallel._logits``), and ``optimize_generate``'s packed
prefill on the model itself (``generate._packed_prefill``); and ``optimize_generate`` gives the model its own
``generate``, ``create_masks_for_generate`` and ``get_compiled_call`` (``generate._adapter``). Each goes through
:func:`install`, which records the value the module had (its class's, or an instance one someone else set, such as a
hook) under the patch's kind, so that :func:`restore` puts exactly that back, and :func:`patch_of` finds a module's
patch of a kind. A module holds one patch per kind; patches stack, and come off in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

KINDS = ("compiled_layers", "skinny_linears", "layer_kernels", "tp_linears", "tp_logits", "packed_prefill", "generate",
         "generate_masks", "compiled_call")
_RECORD = "_hf_paged_patches"  # module attribute: [(kind, attribute, its value before the patch or None: its class's)]


def install(module: torch.nn.Module, kind: str, make: Callable[[Callable], Callable],
            attribute: str = "forward") -> Callable:
    """Give ``module`` the ``attribute`` (its forward, unless named) ``make(current value)`` returns, as a patch of
    ``kind``; returns it. A module that holds a patch of ``kind`` already keeps it (returned as it is)."""
    if kind not in KINDS:
        raise ValueError(f"unknown patch kind {kind!r}; one of {KINDS}")
    if (existing := patch_of(module, kind)) is not None:
        return existing
    record = module.__dict__.setdefault(_RECORD, [])
    before = module.__dict__.get(attribute)
    patched = make(getattr(module, attribute, None))
    record.append((kind, attribute, before))
    object.__setattr__(module, attribute, patched)
    return patched


def patch_of(module: torch.nn.Module, kind: str) -> Callable | None:
    """``module``'s patch of ``kind`` (its current value, or the one a later patch of the same attribute replaced),
    or None."""
    record = module.__dict__.get(_RECORD, [])
    if (index := _index(record, kind)) is None:
        return None
    attribute = record[index][1]
    return next((before for _, name, before in record[index + 1:] if name == attribute), module.__dict__.get(attribute))


def _index(record: list, kind: str) -> int | None:
    """Where ``kind``'s patch is in a module's record, or None."""
    return next((i for i, (k, _, _) in enumerate(record) if k == kind), None)


def patched(modules: Iterable[torch.nn.Module], kind: str) -> list[torch.nn.Module]:
    """The modules of ``modules`` that hold a patch of ``kind``."""
    return [m for m in modules if patch_of(m, kind) is not None]


def restore(modules: Iterable[torch.nn.Module], kind: str) -> int:
    """Take the patches of ``kind`` (and any stacked on them later) off ``modules``; returns how many modules had
    one."""
    count = 0
    for module in modules:
        record = module.__dict__.get(_RECORD, [])
        if (index := _index(record, kind)) is None:
            continue
        for _, attribute, before in reversed(record[index:]):  # the earliest patch of an attribute is undone last
            if before is None:
                module.__dict__.pop(attribute, None)
            else:
                object.__setattr__(module, attribute, before)
        del record[index:]
        if not record:
            module.__dict__.pop(_RECORD, None)
        count += 1
    return count
