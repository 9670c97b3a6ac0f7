"""``optimize_generate(model)``: a leaner compiled ``generate`` decode step on a :class:`PagedAttentionCache`.

With ``PagedAttentionCache(max_new_tokens=...)`` transformers' ``generate`` compiles its decode step by itself
(``docs/guides/cache.md``, "Compiled decode steps"). At batch 1 that step is bound by the host: ``generate`` waits for
every step's tokens, so the GPU idles while the host prepares the next step (the mask code, dynamo's guards) before the
CUDA graph launches. ``optimize_generate`` trims that host path and the step's GPU work, on one model:

- **Planned masks.** ``generate`` asks the model's ``create_masks_for_generate`` for each step's masks; for a
  compileable paged cache every mask is the step's plan, so on decode steps the model's attribute returns the plan
  directly, without transformers' mask preprocessing. Anything else (prefill, another cache, extra mask
  functions) goes the usual way, a model whose class defines its own mask function keeps it, and the first decode
  step goes the usual way too: its answer is what the direct path then returns (the plan alone, or one
  plan per layer type).
- **Fewer guards** (``skip_module_guards=True``). Before each compiled call dynamo evaluates ~3,400 guards for a
  16-layer model, mostly on module attributes. The compile config drops those on ``nn.Module`` objects
  (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``): a change to a module attribute after the first
  compiled call (``model.train()``, a swapped layer) then goes unnoticed by the compiled step, so call
  :func:`restore_generate` (or ``optimize_generate`` again) after such a change.
- **Decode linears** (``decode_linears``, default: where the model is on CUDA in fp16/bf16 and the kernels load).
  The model's linear layers go through hf_paged's skinny kernel (``hf_paged.kernels._skinny``: a decode step's few
  rows stream the weight at close to copy bandwidth; prefill's many rows keep ``F.linear``), and an inductor pass
  groups the products that share an input (q/k/v, gate/up) into one launch each.
- **No collector pause inside a call.** ``model.generate`` sets the objects that exist when it starts aside from
  Python's garbage collector until it returns, as ``generate_batch`` does (``hf_paged/_frozen_heap.py``): the
  compile leaves a full collection due, which would otherwise fall inside a later call.
- **Decode graphs** (``graphs=True``). Decode steps run as hf_paged's own model calls (the model's compiled layers,
  as in the engine) and are replayed from CUDA graphs hf_paged captures, keyed by the step and the input shapes,
  with none of dynamo's per-call work (``hf_paged/generate/_decode_graphs.py``; other calls take transformers'
  compiled call).
- **Packed prefill** (``packed_prefill=True``). The prompt forward of a left-padded batch (two rows or more) runs its
  real tokens in one row as hf_paged's own model call, with the compiled layers, and computes logits for each row's
  last token only: no matrix product or eager norm on the padding (``hf_paged/generate/_packed_prefill.py``).

The compile config is set as ``model.generation_config.compile_config`` (CUDA graphs, as transformers' default
``mode="reduce-overhead"`` gives them); a ``compile_config`` passed to ``generate`` replaces it for that call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from transformers import CompileConfig

from hf_paged import _compat
from hf_paged.compile import _layers as compiled_layers
from hf_paged.compile import _patches as patches
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.compile._group_linears import GroupLinears
from hf_paged.generate._adapter import PlannedMasks
from hf_paged.generate._decode_graphs import DecodeSteps
from hf_paged.generate._packed_prefill import PackedPrefill
from hf_paged._frozen_heap import frozen_heap

logger = logging.getLogger("hf_paged")

_STATE = "_hf_paged_generate"  # the compile config and linears optimize_generate changed, for restore_generate


def optimize_generate(model: torch.nn.Module, *, decode_linears: bool | None = None,
                      skip_module_guards: bool = True, graphs: bool = True,
                      packed_prefill: bool = True) -> torch.nn.Module:
    """Make ``model.generate``'s compiled decode steps on a compileable :class:`PagedAttentionCache` cheaper;
    returns ``model``. Calling it again replaces the earlier settings; :func:`restore_generate` undoes it.

    At small batch a compiled decode step is bound by the host, so this trims what runs between two steps: on
    decode steps the model's mask builder returns the cache's planned step directly, dynamo skips its guards on nn
    modules, the linear layers run on hf_paged's skinny kernel (q/k/v and gate/up in one launch each), and each
    decode step replays a CUDA graph hf_paged captured. The prompt forward of several rows on a paged cache runs its
    real tokens packed in one row, through the same compiled layers. Other caches and other models are untouched.
    After changing a module of ``model`` (``model.train()``, a swapped layer), call it again: with the guards
    skipped, the compiled step would not notice.

    Args:
        decode_linears: route the linear layers through hf_paged's skinny kernel, grouped (None: where it can
            serve, i.e. the model on CUDA in float16/bfloat16 with the kernels loaded; True: the same or an error
            saying why not; False: never).
        skip_module_guards: drop dynamo's guards on nn modules from the compiled decode step.
        graphs: run decode steps as hf_paged's own model calls, replayed from CUDA graphs it captures, without
            dynamo on the way (``hf_paged/generate/_decode_graphs.py``; other calls: transformers' compiled call).
        packed_prefill: run the prompt forward of two rows or more on a :class:`PagedAttentionCache` with its real
            tokens packed in one row, as hf_paged's own model call with the model's compiled layers (no matrix
            product or norm on the padding; ``hf_paged/generate/_packed_prefill.py``), on CUDA; not for a model
            whose class makes its own masks (token types, images).

    Raises:
        ValueError: ``decode_linears=True`` where the kernel cannot serve the model.
    """
    restore_generate(model)
    linears = skinny_linear.install(model) if skinny_linear.for_engine(model, decode_linears, "decode_linears") else []
    skinny_linear.route_always(linears, True)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if skip_module_guards else {}
    if linears:
        options[_compat.INDUCTOR_CUSTOM_PRE_PASS] = GroupLinears()
    before = getattr(model.generation_config, "compile_config", None)
    model.generation_config.compile_config = with_options(before or CompileConfig(), options)
    object.__setattr__(model, _STATE, {"compile_config": before, "linears": linears})
    compiled = compiled_layers.for_engine(model, None) if graphs or packed_prefill else None
    skinny = bool(linears)
    # each a patch of compile/_patches.py, which restore_generate takes off (with any patch stacked on them later)
    patches.install(model, "generate", FrozenHeapGenerate, "generate")
    if getattr(type(model), "create_masks_for_generate", None) is None:  # (a class that makes its own: token types)
        patches.install(model, "generate_masks", lambda _: PlannedMasks(), "create_masks_for_generate")
        if packed_prefill:
            patches.install(model, "packed_prefill", lambda forward: PackedPrefill(model, forward, compiled, skinny))
    else:
        logger.info("hf_paged: optimize_generate keeps %s's own create_masks_for_generate and prompt forward",
                    type(model).__name__)
    if graphs:
        patches.install(model, "compiled_call",
                        lambda usual: DecodeSteps(model, usual, compiled, skinny).get_compiled_call, "get_compiled_call")
    _forget_compiled_call(model)
    return model


class FrozenHeapGenerate:
    """``model.generate`` under :func:`optimize_generate`: the generate the model had (``inner``: its class's, bound,
    or an instance one set before), run with the collector's old objects set aside (``hf_paged/_frozen_heap.py``).
    A deep copy of the model gets one for the copy (a bound method is deep-copied with its model)."""

    def __init__(self, inner: Callable):
        self.inner = inner
        functools.update_wrapper(self, inner)

    def __call__(self, *args, **kwargs):
        with frozen_heap():
            return self.inner(*args, **kwargs)


def restore_generate(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`optimize_generate` on ``model`` (nothing if it was not optimized); returns ``model``."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return model
    skinny_linear.route_always(state["linears"], False)
    patches.restore([model], "generate")  # (and every patch installed after it)
    _forget_compiled_call(model)
    model.generation_config.compile_config = state["compile_config"]
    return model


def _forget_compiled_call(model: torch.nn.Module) -> None:
    """Drop the compiled forward generate keeps on the model: the next compiled step traces the model anew."""
    for name in _compat.COMPILED_CALL_ATTRIBUTES:
        model.__dict__.pop(name, None)


def with_options(config: CompileConfig, options: dict) -> CompileConfig:
    """A copy of ``config`` with ``options`` added: torch.compile takes a mode or options, not both, so a
    ``"reduce-overhead"`` mode becomes the CUDA-graph option it stands for."""
    merged = dict(config.options or {})
    mode = config.mode
    if options and mode is not None:
        if mode != "reduce-overhead" or config.backend != "inductor":
            raise ValueError(f"the compile config's mode {mode!r} (backend {config.backend!r}) cannot take options; "
                             "set generation_config.compile_config with mode=None and its options instead")
        merged[_compat.INDUCTOR_CUDAGRAPHS], mode = True, None
    merged.update(options)
    out = CompileConfig(fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend, mode=mode,
                        options=merged or None)
    _compat.set_compile_all_devices(out, _compat.compile_all_devices(config))
    return out
