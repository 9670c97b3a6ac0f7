"""A ``torch.compile`` backend for ``generate``'s decode step: inductor's code replayed from one plain CUDA graph.

``generate`` compiles its decode forward with ``mode="reduce-overhead"`` by default: inductor's code run through
CUDA graph trees. At batch 1 the step's GPU work is ~1.3 ms for a 1B model, and the host time of the compiled call
(guards, the AOT runtime wrappers, graph trees' per-input bookkeeping over ~150 parameters, the launch) is ~0.45
ms of it that the GPU waits for, since ``generate`` synchronizes on every step. This backend compiles with inductor
(graphs off), then captures the whole compiled call, wrappers included, into one ``torch.cuda.CUDAGraph``. A
replay copies the inputs that live at new addresses each step (input ids, positions) into buffers of its own,
checks that the inputs marked static (parameters, buffers, ``PagedAttentionCache``'s pool and plan, marked by
``torch._dynamo.mark_static_address``) are where they were at capture, replays, and returns copies of the outputs.

Use it through :func:`compile_config`::

    out = model.generate(**inputs, past_key_values=cache, compile_config=hf_paged.compile_config())

On other devices than CUDA the backend returns inductor's code as it is (no graph).

What a replay relies on, and checks:
- Static inputs keep their address: checked every call (one ``data_ptr`` per input); when one moved (a new cache
  of the same shape, a model moved between devices) the step is captured again.
- Non-tensor inputs (sizes) and the shapes of copied inputs are the captured ones: checked; a change captures
  again (``compile_config`` compiles static shapes, so dynamo recompiles for a new batch size first).
- Inputs at new addresses are only read by the step (true of a decoder's ids, positions and cache positions); the
  graph reads them from its own buffers, filled before each replay.
- Outputs are copied out of the graph's memory, so a caller may keep them across steps
  (``output_hidden_states`` in ``generate``'s returned dict, for one).
A capture that fails (an op that cannot be captured) is logged once, and that graph's calls run uncaptured.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

logger = logging.getLogger("hf_paged")

_MAX_CAPTURES = 8  # per compiled graph; past it the graph runs uncaptured (something moves every step)


def compile_config(*, fullgraph: bool = False, dynamic: bool | None = False,
                   inductor_options: dict | None = None):
    """A ``transformers.CompileConfig`` whose backend is :class:`GraphedInductor`, for ``generate(compile_config=)``
    or ``model.generation_config.compile_config``. ``inductor_options`` patch inductor's config for this compile
    (``triton.cudagraphs`` stays off: the backend captures by itself)."""
    from transformers import CompileConfig

    return CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend=GraphedInductor(inductor_options), mode=None)


class GraphedInductor:
    """``torch.compile`` backend: inductor, then one CUDA graph per compiled graph (see the module doc).

    ``graphs`` lists the :class:`GraphedCall` of every graph compiled so far (its ``captures`` and ``failure``
    say how it runs). ``compiler`` and ``capture`` replace inductor and the CUDA-graph capture, and
    ``graph_devices`` the device types captured: how the CPU tests drive the replay logic."""

    def __init__(self, inductor_options: dict | None = None, *, compiler=None, capture=None,
                 graph_devices: tuple[str, ...] = ("cuda",)):
        options = dict(inductor_options or {})
        if options.get("triton.cudagraphs"):
            raise ValueError("GraphedInductor captures CUDA graphs itself: leave inductor's triton.cudagraphs off")
        self.inductor_options = {**options, "triton.cudagraphs": False}
        self.compiler = compiler or self._inductor
        self.capture = capture or cuda_graph_capture
        self.graph_devices = graph_devices
        self.graphs: list[GraphedCall] = []

    def __deepcopy__(self, memo) -> GraphedInductor:
        return self  # generate deep-copies its compile config; one backend keeps one identity (no recompiles)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        compiled = self.compiler(gm, example_inputs)
        run = (lambda args: compiled(list(args))) if getattr(compiled, "_boxed_call", False) else (
            lambda args: compiled(*args))
        devices = [t.device for t in example_inputs
                   if isinstance(t, torch.Tensor) and t.device.type in self.graph_devices]
        if not devices:
            return lambda *args: run(args)
        self.graphs.append(GraphedCall(run, example_inputs, devices[0], self.capture))
        return self.graphs[-1]

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=self.inductor_options)


def cuda_graph_capture(run, inputs: list, device: torch.device):
    """Capture ``run(inputs)`` into a CUDA graph (its own memory pool): ``(replay, outputs)``; nothing runs yet."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = run(inputs)
    return graph.replay, outputs


def is_static_input(t: torch.Tensor) -> bool:
    """A parameter, or a tensor dynamo was told keeps its address (``mark_static_address``, module buffers)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


class GraphedCall:
    """One compiled graph: the first call runs uncaptured (warm-up), the second captures and replays."""

    def __init__(self, run, example_inputs: list, device: torch.device, capture=cuda_graph_capture):
        self.run = run
        self.device = device
        self.capture = capture
        tensors = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)]
        self.static_index = [i for i in tensors if is_static_input(example_inputs[i])]
        self.copied_index = [i for i in tensors if not is_static_input(example_inputs[i])]
        self.other_index = [i for i, t in enumerate(example_inputs) if not isinstance(t, torch.Tensor)]
        self.captures = 0
        self.failure: str | None = None
        self._warm = False
        self._replay = None
        self._static_ptrs: list[int] = []
        self._others: list = []
        self._buffers: list[torch.Tensor] = []
        self._outputs = None

    def __call__(self, *args):
        if self.failure is not None or not self._warm:
            self._warm = True
            return self.run(args)
        if self._replay is None or not self._matches(args):
            if self.captures >= _MAX_CAPTURES:
                self._give_up(f"its inputs moved or changed shape {self.captures} times")
                return self.run(args)
            try:
                self._capture(args)
            except Exception as exc:  # an op that cannot be captured: run this graph uncaptured from now on
                self._give_up(f"capture failed: {type(exc).__name__}: {exc}")
                return self.run(args)
        for i, buffer in zip(self.copied_index, self._buffers):
            buffer.copy_(args[i])
        self._replay()
        return tree_map_only(torch.Tensor, torch.clone, self._outputs)

    def _matches(self, args) -> bool:
        """The captured graph serves ``args``: static inputs where they were, the same sizes and other values."""
        return ([args[i].data_ptr() for i in self.static_index] == self._static_ptrs
                and [args[i] for i in self.other_index] == self._others
                and all(args[i].shape == b.shape and args[i].dtype == b.dtype
                        for i, b in zip(self.copied_index, self._buffers)))

    def _capture(self, args) -> None:
        self._replay, self._outputs = None, None
        self._buffers = [torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype,
                                             device=args[i].device).copy_(args[i]) for i in self.copied_index]
        inputs = list(args)
        for i, buffer in zip(self.copied_index, self._buffers):
            inputs[i] = buffer
        self._replay, self._outputs = self.capture(self.run, inputs, self.device)
        self._static_ptrs = [args[i].data_ptr() for i in self.static_index]
        self._others = [args[i] for i in self.other_index]
        self.captures += 1
        logger.debug("hf_paged: captured a compiled step (%d inputs copied per replay, %d static; capture %d)",
                     len(self.copied_index), len(self.static_index), self.captures)

    def _give_up(self, reason: str) -> None:
        if self.failure is None:
            logger.warning("hf_paged: a compiled step runs without its CUDA graph (%s); results are the same, "
                           "steps are slower", reason)
        self.failure = reason
        self._replay, self._outputs, self._buffers = None, None, []
