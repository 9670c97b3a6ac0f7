"""``optimize_generate``'s decode steps: a compiled ``generate``'s static paged decode steps, run and replayed by
hf_paged.

At batch 1 a compiled decode step's GPU work is ~1.3 ms for a 1B model and the compiled call's host time ~0.4 ms,
which the GPU waits for (``generate`` synchronizes every step): dynamo's guards, the AOT runtime wrappers, CUDA graph
trees' input bookkeeping. On a compileable :class:`PagedAttentionCache` every decode step of a batch runs on the same
step object (fixed shapes at fixed addresses, updated in place by the cache before each forward: ``_static_decode.py``)
and only the token ids and positions change.

:class:`DecodeSteps`, which ``optimize_generate`` installs as ``model.get_compiled_call``, runs such a step the way
the engine runs its decode steps: as hf_paged's own model call (``runner``'s ``model_call``: the step in the forward
context, the model's compiled layers, the skinny linears), its first call for each batch shape eagerly, its second
captured with the runner's CUDA-graph mechanism (``CudaGraphs``), every later one by copying the ids and positions
into the graph's buffers and replaying. No dynamo runs on the way, and no dynamo internals are read: the forward's
Python runs at the warm-up and the capture only, and what it does beyond the device work is known, since hf_paged
makes the call: it returns the model's output (a replay returns one of the same class, holding the captured logits
and the step's cache) and marks the cache's step as read (a replay marks it itself). Anything else (a step that is
not a static paged decode step, other tensor inputs, output flags, a model off CUDA) runs transformers' compiled call.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_paged.attention._step import PagedStep
from hf_paged.compile._layers import CompiledLayers
from hf_paged.generate._adapter import planned_step
from hf_paged.generate._paged_cache import PagedAttentionCache
from hf_paged.hf.compat import cache_in
from hf_paged.runner._cuda_graphs import CudaGraphs
from hf_paged.runner._model_call import model_call

logger = logging.getLogger("hf_paged")

MAX_GRAPHS_PER_CACHE = 8  # keys (batch shapes) kept per cache; the oldest goes first
_MOVING = ("input_ids", "position_ids")  # the tensors copied into the graph's buffers before each replay
_FLAGS = ("use_cache", "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states")


@dataclass
class _Graph:
    step: PagedStep  # held, so that the step's id in the key is not reused while the graph lives
    inputs: dict[str, torch.Tensor]  # the graph's copies of the moving inputs
    output_type: type  # the forward's ModelOutput class
    fields: dict  # its fields at capture, the cache's left out (the graph must not keep the cache alive)
    cache_fields: tuple[str, ...]  # the fields that held the cache


class DecodeSteps:
    """``model.get_compiled_call`` under ``optimize_generate`` (see the module docstring): returns itself for every
    compile config, as the callable ``generate`` calls each decode step with.

    ``usual``: transformers' ``get_compiled_call`` (bound), which serves every call this object does not run.
    ``compiled``: the model's compiled layers (or None); ``skinny``: route the linears through the skinny kernel.
    ``new_graphs`` makes the :class:`CudaGraphs` of a cache's steps on a device, and ``devices`` are the device
    types run here (the CPU tests drive the logic with stand-ins)."""

    def __init__(self, model: torch.nn.Module, usual, compiled: CompiledLayers | None, skinny: bool,
                 new_graphs: Callable[[torch.device], CudaGraphs] = CudaGraphs, devices: tuple[str, ...] = ("cuda",)):
        self.model, self.usual, self.compiled, self.skinny = weakref.proxy(model), usual, compiled, skinny
        self.new_graphs, self.devices = new_graphs, devices
        self.compile_config = None
        # cache -> (its CudaGraphs, {key: _Graph}, the keys run once (eagerly) on it)
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.failure: str | None = None  # why this model's steps are not run here (then: transformers' call)
        self.replays = 0

    def get_compiled_call(self, compile_config=None):
        """What ``model.get_compiled_call(compile_config)`` returns: this object (steps it does not run go to
        transformers' compiled call for the same config)."""
        self.compile_config = compile_config
        return self

    def __call__(self, *args, **kwargs):
        key = None if args or self.failure is not None else self.key(kwargs)
        if key is None:
            return self.usual(self.compile_config)(*args, **kwargs)
        cache = cache_in(kwargs)
        if cache not in self.graphs:
            self.graphs[cache] = (self.new_graphs(kwargs["input_ids"].device), {}, set())
        graphs, by_key, warm = self.graphs[cache]
        graph = by_key.get(key)
        if graph is None:
            if key not in warm:  # a new shape: run it once eagerly (the compiled layers meet its shapes)
                warm.add(key)
                return self._run(kwargs)
            graph = self._capture(graphs, key, kwargs)
            if graph is None:
                return self.usual(self.compile_config)(**kwargs)
            by_key[key] = graph
            while len(by_key) > MAX_GRAPHS_PER_CACHE:
                graphs.drop(old := next(iter(by_key)))
                del by_key[old]
        for name, buffer in graph.inputs.items():
            buffer.copy_(kwargs[name])
        logits = graphs.replay(key)
        cache.mark_step_read()  # what the forward's cache.update calls do
        self.replays += 1
        return graph.output_type(**{**graph.fields, "logits": logits}, **dict.fromkeys(graph.cache_fields, cache))

    def key(self, kwargs: dict):
        """The replay key of a call: None unless it is a static paged decode step on its cache, with no other tensor
        input and no output flag beyond the known ones."""
        mask, cache = kwargs.get("attention_mask"), cache_in(kwargs)
        step, layout = planned_step(mask), tuple(mask) if isinstance(mask, dict) else None
        if not (step is not None and step.metadata.static and isinstance(cache, PagedAttentionCache)
                and cache.plan is step.metadata):
            return None
        moving, flags = [], []
        for name, value in kwargs.items():
            if name in ("attention_mask", "cache", "past_key_values"):
                continue
            if isinstance(value, torch.Tensor):
                if name not in _MOVING or value.device.type not in self.devices:
                    return None
                moving.append((name, tuple(value.shape), tuple(value.stride()), value.dtype, value.device))
            elif name in _FLAGS and (value is None or isinstance(value, (bool, int))):
                if name.startswith("output_") and value:
                    return None
                flags.append((name, value))
            else:
                return None
        if not moving:
            return None
        meta = step.metadata
        shape = (tuple(meta.block_tables.shape), meta.max_seqlen_k, meta.block_size)  # ids of dead steps come back
        return id(step), shape, layout, tuple(moving), tuple(sorted(flags))

    @torch.no_grad()
    def _run(self, kwargs: dict):
        """The forward as hf_paged's own model call: the step in the forward context, no mask, the rows' tokens in
        one row (``[1, batch]``, as the engine's decode steps and the packed prefill run: the compiled layers then
        serve both with one trace), the logits given back as ``[batch, 1, vocab]``."""
        step = planned_step(kwargs["attention_mask"])
        rows = kwargs["input_ids"].shape[0]
        packed = {name: kwargs[name].view(1, rows) for name in _MOVING if name in kwargs}
        if "logits_to_keep" in kwargs:
            packed["logits_to_keep"] = 0  # every token of the one row is a sequence's last
        with model_call(step, self.compiled, self.skinny):
            output = self.model(**{**kwargs, **packed, "attention_mask": None})
        output.logits = output.logits.view(rows, 1, -1)
        return output

    def _capture(self, graphs: CudaGraphs, key, kwargs: dict) -> _Graph | None:
        inputs = {name: kwargs[name].clone() for name in _MOVING if name in kwargs}
        cache = cache_in(kwargs)
        captured = {}

        def step():
            captured["output"] = output = self._run({**kwargs, **inputs})
            return output.logits

        try:
            reason = graphs.capture([(key, step, False)])
        except Exception as err:  # noqa: BLE001 - a step that cannot be captured runs as transformers runs it
            reason = f"{type(err).__name__}: {err}"
        if reason is not None:
            graphs.drop(key)
            self.failure = f"capturing a decode step failed: {reason}"
            logger.warning("hf_paged: optimize_generate replays no decode step of %s: %s",
                           self.model.__class__.__name__, self.failure)
            return None
        output = captured["output"]
        fields = {name: value for name, value in output.items() if value is not cache and name != "logits"}
        return _Graph(planned_step(kwargs["attention_mask"]), inputs, type(output), fields,
                      tuple(name for name, value in output.items() if value is cache))

