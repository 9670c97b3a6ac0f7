"""``CudaGraphs``: model steps captured as CUDA graphs that share one memory pool, and replayed by key.

The one CUDA-graph mechanism of hf_paged: the engine's decode graphs (``runner/_decode_graphs.py``: one per padded
batch size) and ``optimize_generate``'s (``generate/_decode_graphs.py``: one per batch shape of a ``generate`` call)
both capture through it. A step is a function that runs the model on fixed buffers (its inputs copied in before a
replay) and returns the tensors it computes; capturing it records its device work, and a replay runs that work again
with no Python, so a step function must do nothing else that matters.

Captures run on a side stream that waits for the device work queued before (a replay may still read the buffers);
a step may first run eagerly (``warm``) so that lazy initialisation (libraries, workspaces, a compile of a new shape)
stays out of the graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable

import torch


class CudaGraphs:
    """Graphs captured on ``device`` into one memory pool, by key."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pool = None
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.warmup_seconds = 0.0  # host time of the eager warm-ups
        self.capture_seconds: dict[Hashable, float] = {}  # host time of each key's capture (instantiation included)
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list:
        return list(self._graphs)

    def capture(self, steps: Iterable[tuple[Hashable, Callable[[], object], bool]],
                prepare: Callable[[Hashable], None] | None = None,
                check: Callable[[], str | None] | None = None) -> str | None:
        """Capture each ``(key, step, warm)`` in turn; ``warm``: run the step eagerly first. ``prepare(key)`` runs
        on the capture stream before each (filling the step's buffers); ``check()``, after a warm-up, says why the
        step must not be captured (None: it may). Returns None, or that reason (what was captured before stays).

        The host does not wait for the device: the warm-ups run on the side stream after the work queued before,
        the captures record without running, and the device work queued after waits for the side stream. So a
        capture in the middle of a run (an engine's first decode step, an on-demand size) is host work that
        overlaps the steps the device is still running (``torch.cuda.graph`` would first wait for the device and
        empty the allocator's caches, which the next steps then fill again)."""
        stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.stream(stream):
                for key, step, warm in steps:
                    if prepare is not None:
                        prepare(key)
                    if warm:
                        began = time.perf_counter()
                        step()
                        self.warmup_seconds += time.perf_counter() - began
                        if check is not None and (reason := check()) is not None:
                            return reason
                    graph = torch.cuda.CUDAGraph()
                    began = time.perf_counter()
                    outputs = _recorded(graph, self._pool, step)
                    self.capture_seconds[key] = time.perf_counter() - began
                    self._graphs[key] = (graph, outputs)
        finally:
            current.wait_stream(stream)
        return None

    def replay(self, key: Hashable):
        """Run the graph of ``key``; returns the tensors its step returned at capture (overwritten by each replay)."""
        graph, outputs = self._graphs[key]
        graph.replay()
        self.replays += 1
        return outputs

    def drop(self, key: Hashable) -> None:
        """Forget the graph of ``key`` (its memory stays in the pool, for the other graphs to reuse)."""
        self._graphs.pop(key, None)

    def held_bytes(self) -> int | None:
        """Bytes of the pool's segments (intermediates included); None where the allocator does not name pools."""
        return None if self._pool is None else pool_bytes(self.device, self._pool)

    def release(self) -> None:
        """Free every graph now (and what it holds, collectives included); no replay follows."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()


def _recorded(graph: torch.cuda.CUDAGraph, pool, step: Callable[[], object]) -> object:
    """Record ``step`` into ``graph`` on the current stream, in ``pool``; returns what it returned. Capture errors
    are this thread's only (``thread_local``): other threads may use the device meanwhile."""
    graph.capture_begin(pool, capture_error_mode="thread_local")
    try:
        outputs = step()
    except BaseException:
        try:
            graph.capture_end()  # ends the stream's capture; the graph is not kept
        except RuntimeError:
            pass  # a capture the failure invalidated: the step's own error is the one to see
        raise
    graph.capture_end()
    return outputs


def pool_bytes(device: torch.device, pool) -> int | None:
    """Bytes of the caching allocator's segments owned by memory pool ``pool`` on ``device``; None where the
    snapshot does not say which pool owns a segment."""
    try:
        segments = torch.cuda.memory_snapshot()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return sum(s["total_size"] for s in segments
                   if s.get("device", index) == index and tuple(s["segment_pool_id"]) == tuple(pool))
    except (KeyError, TypeError, RuntimeError):
        return None
