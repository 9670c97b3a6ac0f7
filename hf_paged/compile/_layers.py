"""``CompiledLayers``: the model's work outside attention, compiled with ``torch.compile`` for the engine's steps.

HF's eager modules run each layer of a decode step as ~40 small kernels (RMSNorm in ~6, rotary in ~10, SiLU x mul,
residual adds) around a few matrix products: at batch 1 their launches are most of the step, even inside a CUDA
graph. Inductor fuses them into a handful per layer. Every decoder layer's ``forward`` and the base model's other
children (final norm, rotary embedding) are compiled with dynamic shapes; the KV write and attention stay out of the
compiled graphs: the ``"hf_paged"`` attention function is opaque to the compiler (one graph break per layer, where
it reads the step from the forward context), so the compiled graphs hold only tensor work on hidden states, and the
paged kernels run as they do eager.
Inside them the skinny linears that share an input (q/k/v, gate/up) run as one grouped call
(``hf_paged.compile._group_linears``, passed in this compile's own inductor options), as one product where more
rows than the skinny kernel serves come (the model's first compile lays their weights end to end in one buffer:
``hf_paged.compile._packed_weights``), and under tensor parallel each
all-reduce takes the residual add and RMSNorm after it into its kernel (``hf_paged.parallel._fuse_all_reduce``, the
passes the engine gives a tensor-parallel model's layers).

The compiled forwards are set on the module instances but serve only calls made inside :meth:`CompiledLayers.active`
(the engine's model calls); any other caller of the model in the process (``generate``, another library) runs the
eager modules. A failure of the compiler switches the model back to its eager modules for good (warned once) and
reruns the call eagerly (a layer's forward is pure apart from its KV write, which writes the same values again).
Errors raised by the model's own code pass through unchanged.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hf_paged import _compat
from hf_paged.compile import _patches as patches
from hf_paged.compile._cache import CompileArtifacts, artifact_key
from hf_paged.compile._group_linears import GroupLinears
from hf_paged.compile._kernel_funcs import route_around
from hf_paged.compile._packed_weights import pack_siblings
from hf_paged.hf._placement import base_model, decoder_layers

logger = logging.getLogger("hf_paged")

_ATTRIBUTE = "_hf_paged_compiled_layers"


def compile_unsupported_reason(model: torch.nn.Module, any_device: bool = False) -> str | None:
    """None if the engine can compile ``model``'s layers (on a CUDA device, or on any with ``any_device``), else
    why not."""
    if decoder_layers(model) is None:
        return "no list of decoder layers found on the model"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"the model is split over {', '.join(sorted(map(str, devices)))}; compiled layers serve one device"
    device = next(iter(devices))
    if device.type != "cuda" and not any_device:
        return f"the model is on {device.type}; compiled layers serve CUDA models unless asked for"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "triton is not installed (torch.compile needs it on CUDA)"
    return None


#: Dynamo settings of every layer compile: a graph break inside a nested call (the attention's) resumes in one graph
#: with the rest of its caller, where this torch has the option. A decoder layer then traces as one frame instead of
#: one per module around the break plus one per resume function: on a CPU (4-layer tiny Llama, 6 prompts) 8 frames
#: instead of 22, dynamo 14.7 s instead of 18.1 s in a first process and 3.3 s instead of 5.3 s in a second, the same
#: tokens; the GPU figures are in the benchmarks docs (cold start).
DYNAMO_DEFAULTS = ({_compat.NESTED_GRAPH_BREAKS: True} if _compat.has_dynamo_option(_compat.NESTED_GRAPH_BREAKS)
                   else {})


@dataclass(frozen=True)
class LayerCompile:
    """How a model's layers are compiled: ``graph_pass``, the custom pass inductor runs on each layer's graph (the
    grouped skinny linears by default; tensor parallel adds the fused all-reduces, ``hf_paged.parallel``);
    ``inductor``, more inductor options of the layers' own compile; ``dynamo``, dynamo settings while the compiled
    layers serve a call."""

    graph_pass: GroupLinears = field(default_factory=GroupLinears)
    inductor: dict = field(default_factory=dict)
    dynamo: dict = field(default_factory=lambda: dict(DYNAMO_DEFAULTS))

    def inductor_options(self) -> dict:
        return {_compat.INDUCTOR_CUSTOM_PRE_PASS: self.graph_pass, **self.inductor}

    def cache_settings(self) -> dict:
        """What of this compile decides the compiled code, as plain values (the compile artifacts' key): the pass's
        ``uuid`` (a hash of its source and settings), the options, and the process's rank in a distributed run."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return {"pass": self.graph_pass.uuid().hex(), "inductor": sorted(map(str, self.inductor.items())),
                "dynamo": sorted(map(str, self.dynamo.items())),
                "rank": [torch.distributed.get_rank(), torch.distributed.get_world_size()] if distributed else None}


def compiled_layers(model: torch.nn.Module, how: LayerCompile | None = None) -> CompiledLayers:
    """The model's :class:`CompiledLayers`, installed on first use (compiled as ``how`` says) and shared by every
    engine of the model."""
    if (layers := getattr(model, _ATTRIBUTE, None)) is None:
        pack_siblings(model)  # before the first trace: the grouped-linears pass reads the weights' layout
        layers = CompiledLayers(model, how or LayerCompile())
        object.__setattr__(model, _ATTRIBUTE, layers)  # not a submodule
        # what an earlier process compiled for this model goes to torch's caches before anything compiles; what this
        # one compiles is saved after the engine's start (its owner calls save) and at exit
        layers.artifacts.load()
        atexit.register(layers.artifacts.save)  # what was compiled after the last save: graph sizes, new shapes
    return layers


class CompiledLayers:
    """Compiled forwards of ``model``'s decoder layers and base-model children, serving calls inside ``active()``."""

    def __init__(self, model: torch.nn.Module, how: LayerCompile):
        if (layers := decoder_layers(model)) is None:
            raise ValueError(f"{type(model).__name__} has no list of decoder layers to compile")
        base = base_model(model)
        others = [m for m in base.children() if m is not layers and not isinstance(m, torch.nn.Embedding)]
        self.enabled = True
        self.failure: str | None = None
        self.warm_batch_sizes: set[int] = set()  # decode batch sizes run through the compiled code already
        self._local = threading.local()
        self._modules = [*layers, *others]
        self._recompile_limit = 8 * len(self._modules) + 16
        self.how = how
        self.artifacts = CompileArtifacts(artifact_key(model, how.cache_settings()))  # kept across processes
        for module in self._modules:
            patches.install(module, "compiled_layers", lambda eager: _Switch(self, eager))
        # traced without kernels' routing wrapper, whose try block would end a graph at each attention's break
        self._routed = route_around(layers, "compiled_layers")

    @contextmanager
    def active(self) -> Iterator[None]:
        """Serve this thread's model calls with the compiled forwards (eager once a compile has failed).

        The layers share their compiled code, but its shapes (a decode batch of one sequence, larger ones, prefill
        chunks) each take a compile, hence a recompile limit above the compiler's default of 8 for the duration of
        the call (and the dynamo settings of :class:`LayerCompile`). Equal
        sizes are not taken for one symbol (duck shaping): the engine's inputs are views of fixed buffers, and a step
        whose token count equals a buffer's width (a full ``max_batch_tokens`` prefill) would otherwise compile
        again, mid-run.
        """
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            if depth == 0:
                dynamo = dict(recompile_limit=self._recompile_limit,
                              accumulated_recompile_limit=max(256, 4 * self._recompile_limit), **self.how.dynamo)
                with _compat.dynamo_config_patch(**dynamo), _compat.no_duck_shaping():
                    yield
            else:
                yield
        finally:
            self._local.depth = depth

    def fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            logger.warning("hf_paged: compiling the model's layers failed (%s); the engine runs them eagerly",
                           self.failure)

    def restore(self) -> None:
        """Put the eager forwards back on the modules (the compiled ones are dropped)."""
        patches.restore([*self._modules, *self._routed], "compiled_layers")
        self.enabled = False


class _Switch:
    """A module's ``forward``: the compiled one inside ``CompiledLayers.active()``, else the eager one."""

    def __init__(self, owner: CompiledLayers, eager):
        self.owner, self.eager = owner, eager
        # options: this compile's inductor config only (the skinny linears sharing an input run as one launch)
        self.compiled = torch.compile(eager, dynamic=True, options=owner.how.inductor_options())

    def __call__(self, *args, **kwargs):
        if self.owner.enabled and getattr(self.owner._local, "depth", 0) > 0:  # inside the owner's active()
            try:
                return self.compiled(*args, **kwargs)
            except _COMPILER_ERRORS as exc:
                self.owner.fail(exc)
        return self.eager(*args, **kwargs)


_COMPILER_ERRORS = _compat.compiler_errors()


def for_engine(model: torch.nn.Module, setting: bool | None,
               how: LayerCompile | None = None) -> CompiledLayers | None:
    """The model's compiled layers per ``Engine(compile_layers=...)``: None (automatic) compiles CUDA models when
    triton is there, True compiles wherever the compiler runs (the CPU included), False never. ``how``: the
    compile's passes and options (the model's first compile decides)."""
    if setting is False:
        return None
    reason = compile_unsupported_reason(model, any_device=setting is not None)
    if reason is not None and setting is True:
        raise ValueError(f"compile_layers=True cannot be served: {reason}; pass compile_layers=False")
    layers = compiled_layers(model, how) if reason is None else None
    if layers is not None and not layers.enabled:
        reason = f"an earlier compile failed ({layers.failure})"
    if reason is not None:
        logger.info("hf_paged: the engine runs the model's layers eagerly: %s", reason)
        return None
    return layers
