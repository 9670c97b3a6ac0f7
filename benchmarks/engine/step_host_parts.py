"""Where an engine decode step's host time goes, piece by piece, and what a CUDA graph launch costs on this host.

Builds the engine of ``benchmarks/engine/overhead.py`` (256 running requests of ~1k tokens; ``--model tiny``: a
one-layer Llama, so decode steps replay CUDA graphs on a GPU) and wraps the step's parts in wall-clock timers (a
fraction of a microsecond each): scheduling, the graph inputs' layout (the block-table sync and the staging copies
within it), the graph launch (or, on the eager path, the step plan, its copy and the forward), the sampling batch, the
sampler's launches, the token copy, the wait for the tokens, the hand-over and the commit. Each timed step is bracketed by a
device synchronization, as in ``benchmarks/engine/overhead.py``. On a GPU it then times ``CUDAGraph.replay()`` alone for
graphs of 1 to 400 small kernels, and counts the kernels one eager decode step of the tiny model launches, so the launch
cost of the engine's graph can be read against the host's cost per graph node.

    python -m benchmarks.engine.step_host_parts [--device cuda] [--vocab 128256] [--steps 200] [--model tiny]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.engine.overhead import add_workload_arguments, build_engine
from hf_paged.engine import _core as engine_core
from hf_paged.engine import _inflight as inflight
from hf_paged.engine import _sampler as sampler
from hf_paged.engine import _scheduler as scheduler
from hf_paged.runner import _device_block_table
from hf_paged.runner import _decode_graphs as cuda_graphs
from hf_paged.runner import _model_runner as runner
from hf_paged.runner import _staging as staging

PARTS = (
    (scheduler.Scheduler, "schedule"),
    (cuda_graphs.DecodeGraphs, "stage"),
    (_device_block_table.DeviceBlockTable, "sync"),
    (staging.StagingBuffer, "host_array"),
    (staging.StagingBuffer, "send"),
    (torch.cuda.CUDAGraph, "replay"),
    (runner.ModelRunner, "forward"),
    (runner.ModelRunner, "_to_device"),
    (sampler.SamplingBatch, "build"),
    (sampler.Sampler, "__call__"),
    (inflight.TokenReceiver, "send"),
    (inflight.InFlightStep, "wait"),
    (engine_core.EngineCore, "_take_tokens"),
    (engine_core.EngineCore, "_commit"),
)


def wrap_parts(totals: dict[str, float]) -> Callable[[], None]:
    """Replace each part by a timed wrapper adding its wall seconds to ``totals[name]``; ``step_plan.plan_step`` (a
    module function) is timed where the engine calls it. Returns the function that puts the parts back."""
    saved = [(runner, "plan_step", runner.plan_step)]
    saved += [(owner, name, owner.__dict__[name]) for owner, name in PARTS]
    for owner, name, raw in saved:
        is_classmethod = isinstance(raw, classmethod)
        fn = raw.__func__ if is_classmethod else raw
        label = name if owner is runner else f"{owner.__name__}.{name}"

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start

        setattr(owner, name, classmethod(timed) if is_classmethod else timed)

    def unwrap() -> None:
        for owner, name, raw in saved:
            setattr(owner, name, raw)

    return unwrap


def graph_launch_cost(device: str, nodes_list=(1, 10, 50, 100, 200, 400), reps: int = 200) -> dict[int, float]:
    """Median host microseconds of ``CUDAGraph.replay()`` for a graph of ``n`` one-element add kernels."""
    out = {}
    x = torch.zeros(1, device=device)
    for n in nodes_list:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(n):
                x.add_(1)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                x.add_(1)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        out[n] = statistics.median(times) * 1e6
    return out


def kernels_per_step(engine) -> int:
    """Kernels one eager decode step of the engine's largest graph size launches (its graph holds as many)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    size = graphs.sizes[-1]
    graphs._stage_padding(size)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs._forward(size)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, model="tiny")
    parser.add_argument("--gc-off", action="store_true", help="disable Python's garbage collector while timing")
    args = parser.parse_args(argv)
    args.profile = 0
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    engine = build_engine(args)
    totals: dict[str, float] = collections.defaultdict(float)
    unwrap = wrap_parts(totals)
    import gc

    try:
        for _ in range(10):
            engine.step()
        totals.clear()
        if args.gc_off:
            gc.collect()
            gc.disable()
        times = []
        for _ in range(args.steps):
            sync()
            start = time.perf_counter()
            engine.step()
            sync()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
        unwrap()
    graphs = (engine.stats().get("cuda_graphs") or {}).get("replays", 0)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{args.requests} requests, vocab {args.vocab}, {args.model} model on {where}, graph replays {graphs}")
    print(f"step: median {statistics.median(times) * 1e3:.3f} ms, mean {statistics.mean(times) * 1e3:.3f} ms, "
          f"min {min(times) * 1e3:.3f} ms (garbage collector {'off' if args.gc_off else 'on'})")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:32s} {seconds / args.steps * 1e3:.3f} ms per step")
    if cuda:
        cost = graph_launch_cost(args.device)
        print("CUDAGraph.replay() host time by graph size:", ", ".join(f"{n} kernels {us:.1f} us"
                                                                    for n, us in cost.items()))
        if engine.runner.graphs is not None:
            print(f"kernels in one decode step of the tiny model (largest graph size): {kernels_per_step(engine)}")


if __name__ == "__main__":
    main()
