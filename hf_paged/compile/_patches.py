"""The one registry of the ``forward`` replacements hf_paged puts on a model's modules.

hf_paged changes a model's behaviour in five ways, each by giving modules a ``forward`` of their own: the compiled
layers (``compile._layers``), the skinny linear routing (``compile._skinny_linears``), a tensor-parallel model's local
products (``parallel._linears``) and its local logits (``parallel._logits``), and ``optimize_generate``'s packed
prefill on the model itself (``generate._packed_prefill``). Each goes through :func:`install`, which
records the forward the module had (its class's, or an instance forward someone else set, such as a hook) under the
patch's kind, so that :func:`restore` puts exactly that back, and :func:`patch_of` finds a module's patch of a kind.
A module holds one patch per kind; patches of different kinds stack, and come off in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

KINDS = ("compiled_layers", "skinny_linears", "tp_linears", "tp_logits", "packed_prefill")
_RECORD = "_hf_paged_patches"  # module attribute: [(kind, forward before the patch or None: its class's)]


def install(module: torch.nn.Module, kind: str, make: Callable[[Callable], Callable]) -> Callable:
    """Give ``module`` the forward ``make(current_forward)`` returns, as a patch of ``kind``; returns it. A module
    that holds a patch of ``kind`` already keeps it (returned as it is)."""
    if kind not in KINDS:
        raise ValueError(f"unknown patch kind {kind!r}; one of {KINDS}")
    existing = patch_of(module, kind)
    if existing is not None:
        return existing
    record = module.__dict__.setdefault(_RECORD, [])
    before = module.__dict__.get("forward")
    patched = make(module.forward)
    record.append((kind, before))
    object.__setattr__(module, "forward", patched)
    return patched


def patch_of(module: torch.nn.Module, kind: str) -> Callable | None:
    """``module``'s patch of ``kind`` (its current forward, or the one a later patch wraps), or None."""
    record = module.__dict__.get(_RECORD, [])
    kinds = [k for k, _ in record]
    if kind not in kinds:
        return None
    index = kinds.index(kind)
    return record[index + 1][1] if index + 1 < len(record) else module.__dict__.get("forward")


def patched(modules: Iterable[torch.nn.Module], kind: str) -> list[torch.nn.Module]:
    """The modules of ``modules`` that hold a patch of ``kind``."""
    return [m for m in modules if patch_of(m, kind) is not None]


def restore(modules: Iterable[torch.nn.Module], kind: str) -> int:
    """Take the patches of ``kind`` (and any stacked on them later) off ``modules``; returns how many modules had
    one."""
    count = 0
    for module in modules:
        record = module.__dict__.get(_RECORD, [])
        kinds = [k for k, _ in record]
        if kind not in kinds:
            continue
        index = kinds.index(kind)
        before = record[index][1]
        del record[index:]
        if before is None:
            module.__dict__.pop("forward", None)
        else:
            object.__setattr__(module, "forward", before)
        if not record:
            module.__dict__.pop(_RECORD, None)
        count += 1
    return count
