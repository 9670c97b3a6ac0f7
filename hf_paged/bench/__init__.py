"""Benchmark helpers: device timing that measures the GPU, not Python, and the copy-bandwidth ceiling.

Timings use CUDA events around a CUDA graph that replays many calls (rotating over several input sets, so the
L2 cache cannot serve them), with warm-up first and the median over repetitions. Callables that cannot be
captured (host syncs) are timed as an eager loop instead; :class:`Timing` says which.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median seconds per call, the spread of repetitions, and how it was measured ("graph" or "eager")."""

    median_s: float
    min_s: float
    max_s: float
    method: str
    reps: int


def _reps_for(seconds_per_call: float, calls_per_rep: int, budget_s: float) -> int:
    return int(min(200, max(5, budget_s / max(seconds_per_call * calls_per_rep, 1e-7))))


def _eager(calls: Sequence[Callable[[], object]], budget_s: float) -> Timing:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    reps = _reps_for((time.perf_counter() - t0) / len(calls), len(calls), budget_s)
    samples = []
    for _ in range(reps):
        start.record()
        for fn in calls:
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / len(calls))
    return Timing(statistics.median(samples), min(samples), max(samples), "eager", reps)


def _graph(calls: Sequence[Callable[[], object]], budget_s: float, min_calls: int) -> Timing:
    rounds = max(1, -(-min_calls // len(calls)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: lazy init, workspace buffers
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: its workspace is reused
        for _ in range(rounds):
            for fn in calls:
                fn()
    n = rounds * len(calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = _reps_for(start.elapsed_time(end) / 1e3 / n, n, budget_s)
    samples = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n)
    return Timing(statistics.median(samples), min(samples), max(samples), "graph", reps)


def time_calls(
    calls: Sequence[Callable[[], object]], budget_s: float = 0.4, graph: bool = True, min_calls: int = 20
) -> Timing:
    """Median device time of one call, each rep running every callable in ``calls`` (one per input set) in turn.

    With ``graph=True`` the calls are captured once into a CUDA graph of at least ``min_calls`` launches (so the
    launch overhead of Python and the driver stays out); if capture fails, they run as an eager loop.
    """
    for fn in calls:  # warm-up (builds, autotuning, allocator)
        fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return _graph(calls, budget_s, min_calls)
        except RuntimeError:
            torch.cuda.synchronize()
    return _eager(calls, budget_s)


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
