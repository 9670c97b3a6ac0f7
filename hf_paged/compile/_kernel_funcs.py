"""Modules whose class ``forward`` is the ``kernels`` package's function router, traced without it.

transformers (5.25 and later, where ``kernels`` is a dependency) decorates attention classes such as Llama's with
``kernels.use_kernelized_func(apply_rotary_pos_emb)``: the class ``forward`` becomes a wrapper that sets a context
variable naming the module's private kernel functions, calls the real ``forward`` inside ``try``/``finally``, and
resets the variable. With no kernel selected (no ``kernelize`` call on the model) the wrapper changes nothing: each
routed call ends in the plain function. But dynamo cannot resume a graph break inside a ``try`` block of a nested
frame, and the ``"hf_paged"`` attention function is such a break: with the wrapper on the stack, the attention
module's rest (``o_proj`` and, under tensor parallel, its all-reduce) becomes a graph of its own instead of joining
the decoder layer's residual add and norm (``hf_paged.compile._fuse_all_reduce``), and every layer traces as more
frames.

:func:`route_around` gives each such module of a compiled layer a ``forward`` that, while dynamo traces and no
kernel is selected, calls the wrapped ``forward`` directly; eagerly, or once a kernel is selected, the wrapper runs
as before. The one private detail read here is the wrapper's shape (``__wrapped__`` on a function defined in the
``kernels`` package, the module's ``_kernel_funcs``); ``tests/compile/test_kernel_funcs.py`` fails when a release
changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hf_paged.compile import _patches as patches


def is_kernel_router(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class ``forward`` is ``kernels``' function-routing wrapper around a ``forward``."""
    forward = getattr(type(module), "forward", None)
    return (callable(getattr(forward, "__wrapped__", None))
            and str(getattr(forward, "__globals__", {}).get("__name__", "")).startswith("kernels.")
            and isinstance(module.__dict__.get("_kernel_funcs"), dict))


def route_around(layers: Iterable[torch.nn.Module], kind: str) -> list[torch.nn.Module]:
    """Give every kernel-routed module inside ``layers`` the traced-without-the-wrapper ``forward``, as a patch of
    ``kind`` (restored with the rest of that kind); returns the modules patched."""
    routed = [m for layer in layers for m in layer.modules() if is_kernel_router(m)]
    for module in routed:
        patches.install(module, kind, lambda eager, module=module: _routed_around(module, eager))
    return routed


def _routed_around(module: torch.nn.Module, eager: Callable) -> Callable:
    """``module``'s ``forward``: the wrapped one while dynamo traces and no kernel is selected (``kernels.kernelize``
    gives a routed function's private module a ``forward`` of its own: the one case where the wrapper changes what a
    traced call does), else ``eager`` (the wrapper). A closure, not an object: dynamo guards on the identity of a
    callable object found on a module, and the decoder layers would then each trace a graph of their own instead of
    sharing the first one's."""
    inner = type(module).forward.__wrapped__

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling() and not any(
                func.forward.__func__ is not type(func).forward for func in module._kernel_funcs.values()):
            return inner(module, *args, **kwargs)
        return eager(*args, **kwargs)

    return forward
