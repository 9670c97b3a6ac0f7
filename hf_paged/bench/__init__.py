"""Benchmark helpers: device timing that measures the GPU, not Python, and the copy-bandwidth ceiling.

Timings use CUDA events around a CUDA graph that replays many calls (rotating over several input sets, so the
L2 cache cannot serve them), with warm-up first and the median over repetitions. Callables that cannot be
captured (host syncs) are timed as an eager loop instead; :class:`Timing` says which. Every result file starts with
:func:`run_header` (card, versions, hf_paged's own commit, date).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_paged.bench._header import run_header, source_commit

__all__ = ["Timing", "copy_bandwidth", "input_sets", "run_header", "source_commit", "time_calls"]


@dataclass(frozen=True)
class Timing:
    """Median seconds per call, the spread of repetitions, and how it was measured ("graph", "eager" or "host")."""

    median_s: float
    min_s: float
    max_s: float
    method: str
    reps: int


def _repeat(run: Callable[[], object], calls_per_rep: int, method: str, budget_s: float, reps: int | None,
            before_rep: Callable[[], object] | None) -> Timing:
    """Per-call figures of ``reps`` timed calls of ``run`` (default: as many as fit ``budget_s`` after one sizing
    call, 5 to 200), ``before_rep`` running before each; each call timed between two CUDA events on the device, or
    by the host clock where ``method`` is "host"."""
    host = method == "host"
    start, end = (None, None) if host else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def seconds() -> float:
        if host:
            t0 = time.perf_counter()
            run()
            return time.perf_counter() - t0
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    reps = reps or int(min(200, max(5, budget_s / max(seconds(), 1e-7))))
    samples = []
    for _ in range(reps):
        if before_rep is not None:
            before_rep()
        samples.append(seconds() / calls_per_rep)
    return Timing(statistics.median(samples), min(samples), max(samples), method, len(samples))


def _graph(run_all: Callable[[], None], num_calls: int, min_calls: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """``run_all`` captured into a CUDA graph as many times as make ``min_calls`` launches; the graph and its calls."""
    rounds = max(1, -(-min_calls // num_calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: lazy init, workspace buffers
        run_all()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: its workspace is reused
        for _ in range(rounds):
            run_all()
    for _ in range(3):
        graph.replay()
    return graph, rounds * num_calls


def time_calls(
    calls: Sequence[Callable[[], object]], budget_s: float = 0.4, graph: bool = True, min_calls: int = 20,
    reps: int | None = None, before_rep: Callable[[], object] | None = None, device: str | torch.device = "cuda",
) -> Timing:
    """Median device time of one call, each rep running every callable in ``calls`` (one per input set) in turn.

    With ``graph=True`` the calls are captured once into a CUDA graph of at least ``min_calls`` launches (so the
    launch overhead of Python and the driver stays out); if capture fails, they run as an eager loop. ``reps``
    fixes the number of repetitions (default: as many as fit ``budget_s``, 5 to 200), as collectives need: every
    rank must run the same count; ``before_rep`` runs before each (a barrier, say), outside the timed span. On a
    ``device`` that is not CUDA the calls run as a loop timed by the host clock (method "host").
    """
    def run_all() -> None:
        for fn in calls:
            fn()

    run_all()  # warm-up (builds, autotuning, allocator)
    if torch.device(device).type != "cuda":
        return _repeat(run_all, len(calls), "host", budget_s, reps, before_rep)
    torch.cuda.synchronize()
    if graph:
        try:
            cuda_graph, launches = _graph(run_all, len(calls), min_calls)
            return _repeat(cuda_graph.replay, launches, "graph", budget_s, reps, before_rep)
        except RuntimeError:
            torch.cuda.synchronize()
    return _repeat(run_all, len(calls), "eager", budget_s, reps, before_rep)


def copy_bandwidth(nbytes: int = 1 << 30) -> tuple[float, dict[str, float]]:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the best of a
    memcpy (graph and eager) and an elementwise kernel, so that the ceiling is not understated. Also returns
    each way's figure, and a read-only figure (a sum over the same bytes) for context."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ways = {
        "memcpy-graph": time_calls([lambda: dst.copy_(src)], budget_s=0.5, min_calls=10),
        "memcpy-eager": time_calls([lambda: dst.copy_(src)], budget_s=0.5, graph=False),
        "kernel-graph": time_calls([lambda: torch.neg(src, out=dst)], budget_s=0.5, min_calls=10),
    }
    rates = {name: 2 * nbytes / t.median_s for name, t in ways.items()}
    rates["read-only-sum"] = nbytes / time_calls([lambda: src.sum()], budget_s=0.5, min_calls=10).median_s
    best = max(v for k, v in rates.items() if k != "read-only-sum")
    return best, rates


def input_sets(bytes_per_set: int, max_sets: int = 8) -> int:
    """How many input sets to rotate so that together they overflow the L2 cache three times."""
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20)
    return int(min(max_sets, max(1, -(-3 * l2 // max(bytes_per_set, 1)))))
