"""Compiled ``generate`` decode steps replayed from CUDA graphs with no dynamo on the way (``optimize_generate``).

At batch 1 a compiled decode step's GPU work is ~1.3 ms for a 1B model and the compiled call's host time ~0.4 ms,
which the GPU waits for (``generate`` synchronizes every step): dynamo's guards, the AOT runtime wrappers, CUDA graph
trees' input bookkeeping. On a compileable :class:`PagedAttentionCache` those checks have a cheaper equivalent:
every decode step of a batch runs on the same plan object (fixed shapes, fixed addresses, ``static_decode.py``) and
the same cache, and only the token ids and positions change. :class:`DecodeGraphs`, which ``optimize_generate``
installs as ``model.get_compiled_call``, so keys each call by the plan, the cache, the shapes of the moving inputs and
the flags; the first call of a key runs the compiled forward (inductor, no CUDA graphs of its own, one graph), the
second captures it into a ``torch.cuda.CUDAGraph`` and every later one copies the ids and positions in and replays.

What a replay skips is the Python the compiled forward runs around its graph. That is only safe when it changes
nothing that matters: after the first compiled call of each new shape the forward's residual bytecode (what dynamo
runs around the graph) is read, and graphs are used only if every name it sets or passes after the graph is known:
the ``ModelOutput`` it builds (a replay builds a new one of the same class, with the captured tensors and the
step's cache), transformers' output collector reset to its idle values, and the cache's ``_plan_used`` flag, which
the replay sets itself. Anything else (another model's forward, another transformers release), any other kind of
call (a step that is not a static paged decode step, extra tensors or output flags), or a CPU model, runs
transformers' own compiled call.
"""

from __future__ import annotations

import dis
import logging
import weakref
from dataclasses import dataclass

import torch

from hf_paged.attention._metadata import PagedMetadata
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.generate._paged_cache import PagedAttentionCache
from hf_paged.hf import _attention as attention

logger = logging.getLogger("hf_paged")

MAX_GRAPHS_PER_CACHE = 8  # keys (batch shapes) kept per cache; the oldest goes first
_MOVING = ("input_ids", "position_ids")  # the tensors copied into the graph's buffers before each replay
_FLAGS = ("use_cache", "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states")
# Names the residual bytecode of a supported forward may use after its graph: the kwargs it reads, the output it
# builds, the output collector's idle values, the cache's flag.
KNOWN_NAMES = frozenset({
    *_MOVING, *_FLAGS, "attention_mask", "cache", "past_key_values", "_plan_used", "logits", "loss", "attentions",
    "hidden_states", "compiling", "global_var",
})
_SETTERS = ("STORE_ATTR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_GLOBAL", "STORE_DEREF")


@dataclass
class _Graph:
    plan: PagedMetadata  # held, so that the plan's id in the key is not reused while the graph lives
    inputs: dict[str, torch.Tensor]  # the graph's copies of the moving inputs
    replay: object
    output_type: type  # the forward's ModelOutput class
    fields: dict  # its fields at capture, the cache's left out (the graph must not keep the cache alive)
    cache_fields: tuple[str, ...]  # the fields that held the cache

    def output(self, cache):
        return self.output_type(**self.fields, **dict.fromkeys(self.cache_fields, cache))


def cuda_graph_capture(run, device: torch.device):
    """Capture ``run()`` into a CUDA graph of its own memory pool: ``(replay, outputs)``; nothing has run yet."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = run()
    return graph.replay, output


class GraphedCalls:
    """``model.get_compiled_call`` under ``optimize_generate``: one :class:`DecodeGraphs` per compile config (a
    new config compiles anew, as transformers' own method does)."""

    def __init__(self, model: torch.nn.Module, usual, capture=None, devices: tuple[str, ...] = ("cuda",)):
        self.model, self.usual, self.capture, self.devices = weakref.proxy(model), usual, capture, devices
        self.current: DecodeGraphs | None = None

    def __call__(self, compile_config=None):
        config = compile_config or self.model.generation_config.compile_config
        if config is None:
            return self.usual(compile_config)
        if self.current is None or self.current.compile_config != config:
            self.current = DecodeGraphs(self.model, config, self.usual, self.capture, self.devices)
        return self.current


class DecodeGraphs:
    """``model.get_compiled_call(compile_config)`` under ``optimize_generate`` (see the module docstring).

    ``usual`` is transformers' ``get_compiled_call`` (bound), for every call this object does not replay;
    ``capture`` replaces :func:`cuda_graph_capture` and ``devices`` the device types replayed (how the CPU tests
    drive the replay logic)."""

    def __init__(self, model: torch.nn.Module, compile_config, usual, capture=None,
                 devices: tuple[str, ...] = ("cuda",)):
        self.model = model
        self.devices = devices
        self.compile_config = compile_config
        self.usual = usual
        self.capture = capture or cuda_graph_capture
        self.compiled = torch.compile(model.__call__, **graphless(compile_config))
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {key: _Graph}
        self.warm: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> keys run once compiled
        self.failure: str | None = None  # why this model's steps are not replayed (then: transformers' call)
        self.checked = False  # whether a forward compiled here once (a later compile error is not a tracing limit)
        self.replays = 0

    def __call__(self, *args, **kwargs):
        key = None if args or self.failure is not None else self.key(kwargs)
        if key is None:
            return self.usual(self.compile_config)(*args, **kwargs)
        cache = _cache_of(kwargs)
        graphs = self.graphs.setdefault(cache, {})
        graph = graphs.get(key)
        if graph is None:
            warm = self.warm.setdefault(cache, set())
            if key not in warm:  # compile (a new shape) and warm up: a plain compiled call
                try:
                    output = self.compiled(**kwargs)
                except Exception as err:  # noqa: BLE001 - tracing fails before the step runs: run it usually
                    if self.checked:  # this model compiled before: not a tracing limit, a real error
                        raise
                    self.failure = f"compiling one graph failed: {type(err).__name__}: {err}"
                    logger.warning("hf_paged: optimize_generate replays no decode step of %s: %s",
                                   self.model.__class__.__name__, self.failure)
                    return self.usual(self.compile_config)(**kwargs)
                self.checked = True
                self._check_residual()  # each new shape's code too
                warm.add(key)
                return output
            graph = self._capture(kwargs)
            if graph is None:
                return self.usual(self.compile_config)(**kwargs)
            graphs[key] = graph
            while len(graphs) > MAX_GRAPHS_PER_CACHE:
                graphs.pop(next(iter(graphs)))
        for name, buffer in graph.inputs.items():
            buffer.copy_(kwargs[name])
        graph.replay()
        cache._plan_used = True  # what the compiled forward's residual bytecode does (checked in _check_residual)
        self.replays += 1
        return graph.output(cache)

    def key(self, kwargs: dict):
        """The replay key of a call: None unless it is a static paged decode step with no other tensor input and no
        output flag beyond the known ones."""
        plan, cache, layout = _plan_of(kwargs.get("attention_mask")), _cache_of(kwargs), None
        if isinstance(kwargs.get("attention_mask"), dict):
            layout = tuple(kwargs["attention_mask"])
        if not (isinstance(plan, PagedMetadata) and plan.static and isinstance(cache, PagedAttentionCache)
                and cache._plan is plan):
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
        shape = (tuple(plan.block_tables.shape), plan.max_seqlen_k, plan.block_size)  # ids of dead plans come back
        return (id(plan), shape, layout, tuple(moving), tuple(sorted(flags)), skinny_linear.is_active(),
                attention.opaque_plans)

    def _capture(self, kwargs: dict) -> _Graph | None:
        plan = _plan_of(kwargs["attention_mask"])
        inputs = {name: kwargs[name].clone() for name in _MOVING if name in kwargs}
        device = next(iter(inputs.values())).device
        try:
            replay, output = self.capture(lambda: self.compiled(**{**kwargs, **inputs}), device)
        except Exception as err:  # noqa: BLE001 - a step that cannot be captured runs as transformers runs it
            self.failure = f"capturing a decode step failed: {type(err).__name__}: {err}"
            logger.warning("hf_paged: optimize_generate replays no decode step of %s: %s",
                           self.model.__class__.__name__, self.failure)
            return None
        cache = _cache_of(kwargs)
        fields = {name: value for name, value in output.items() if value is not cache}
        return _Graph(plan, inputs, replay, type(output), fields,
                      tuple(name for name, value in output.items() if value is cache))

    def _check_residual(self) -> None:
        """After a new shape's first compiled call: graphs only if the forward's residual bytecode is the known one."""
        unknown = residual_names(self.model.__class__.forward)
        if unknown is None:
            self.failure = "the compiled forward's bytecode was not found"
        elif unknown - KNOWN_NAMES:
            self.failure = f"the compiled forward does more around its graph than known ({sorted(unknown - KNOWN_NAMES)})"
        if self.failure is not None:
            logger.info("hf_paged: optimize_generate replays no decode step of %s: %s",
                        self.model.__class__.__name__, self.failure)


def residual_names(forward) -> set[str] | None:
    """Names the code dynamo made for ``forward`` (or a function it wraps) uses after its graph returns (where the
    side effects and the output are made: the attributes it sets, the constants it passes); None when dynamo
    holds no code for it. (Before the graph it only reads: parameters, buffers, the plan's tensors.)"""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    names, found = set(), False
    while forward is not None:
        code = getattr(forward, "__code__", None)
        for entry in _debug_get_cache_entry_list(code) if code is not None else ():
            found, after = True, False
            for ins in dis.get_instructions(entry.code):
                if ins.opname == "STORE_FAST" and str(ins.argval).startswith("graph_out"):
                    after = True
                elif after and (ins.opname in _SETTERS or (ins.opname == "LOAD_CONST" and isinstance(ins.argval, str))):
                    names.add(str(ins.argval))
            if not after:
                names.add("<no graph call found>")
        forward = getattr(forward, "__wrapped__", None)
    return names if found else None


def graphless(compile_config) -> dict:
    """torch.compile's arguments for ``compile_config`` with inductor's own CUDA graphs off and one graph per
    forward (a replay runs none of the Python between graphs)."""
    options = dict(compile_config.options or {})
    mode = compile_config.mode
    if mode == "reduce-overhead":
        mode = None
    if compile_config.backend == "inductor":
        options["triton.cudagraphs"] = False
    return dict(fullgraph=True, dynamic=compile_config.dynamic, backend=compile_config.backend, mode=mode,
                options=options or None)


def _plan_of(mask):
    """The step's plan: the mask itself, or the one plan every layer type's mask is (models with sliding layers)."""
    if isinstance(mask, dict) and mask and len({id(m) for m in mask.values()}) == 1:
        return next(iter(mask.values()))
    return mask


def _cache_of(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))
