"""Steady decode of the hf_paged engine: milliseconds per step and the fraction of wall time the device is busy.

The workload's requests are added to an ``hf_paged.Engine`` and stepped until every prompt is prefilled; then
``steps`` decode steps are timed, and as many again under ``torch.profiler``. Busy fraction = total time covered
by device activity (overlapping intervals merged) / wall time of the profiled steps; ``kernel_us_per_step``: the 25
kernels with the most device time, per step (microseconds, calls). On a CPU (``--smoke``) the same
code profiles host operators instead, so the path is exercised but the number means little.
"""

from __future__ import annotations

import copy
import inspect
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks.e2e.systems import Budget, sync
from benchmarks.e2e.workloads import Workload
from benchmarks.engine.decode_steps import phase_ms_between, step_until_decoding
import hf_paged


def engine_kwargs_split(engine_kwargs: dict) -> tuple[dict, list[str]]:
    """The kwargs ``hf_paged.Engine`` accepts, and the names of those it does not."""
    params = inspect.signature(hf_paged.Engine).parameters
    accepted = {k: v for k, v in engine_kwargs.items() if k in params}
    return accepted, sorted(set(engine_kwargs) - set(accepted))


def profile_decode(model: torch.nn.Module, workload: Workload, budget: Budget, engine_kwargs: dict, vocab: int,
                   steps: int = 20) -> dict:
    """Time ``steps`` pure-decode steps of the engine on the workload, then profile as many; see the module doc."""
    accepted, ignored = engine_kwargs_split({"block_size": 16, **engine_kwargs})
    prompts, gc = workload.prompts(vocab), workload.generation_config()
    block_size = accepted["block_size"]
    num_blocks = sum(-(-(len(p) + workload.new_tokens) // block_size) for p in prompts)
    engine = hf_paged.Engine(model, **{"num_blocks": num_blocks, "max_batch_tokens": budget.max_batch_tokens,
                                       "max_num_seqs": budget.max_requests, **accepted})
    for prompt in prompts:
        engine.add_request(prompt, copy.deepcopy(gc))
    prefill_steps = step_until_decoding(engine)
    for _ in range(3):
        engine.step()
    before = engine.stats()
    wall = _timed_steps(engine, steps)
    after = engine.stats()
    busy = _profiled_steps(engine, steps)
    end = engine.stats()
    decoded = after["generated_tokens"] - before["generated_tokens"]
    pure = decoded == steps * before["running"] and end["running"] == before["running"] and not end["waiting"]
    return {
        "tokens": decoded, "expected_tokens": steps * before["running"], "seconds": wall,
        "batch": before["running"], "steps": steps, "prefill_steps": prefill_steps, "pure_decode": pure,
        "ms_per_step": 1e3 * wall / steps, "phase_ms_per_step": phase_ms_between(before, after),
        "prefill_backend": end.get("prefill_backend"), "decode_backend": end.get("decode_backend"),
        "engine_kwargs_ignored_by_engine": ignored, **busy,
    }


def _timed_steps(engine: hf_paged.Engine, steps: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return time.perf_counter() - start


def _profiled_steps(engine: hf_paged.Engine, steps: int) -> dict:
    """Profile ``steps`` steps after one traced-and-dropped step (the tracer's own start-up cost)."""
    on_cuda = torch.cuda.is_available() and engine.device.type == "cuda"
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with profile(activities=[activity], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        engine.step()
        sync()
        prof.step()
        start = time.perf_counter()
        for i in range(steps):
            engine.step()
            if i < steps - 1:
                prof.step()
        sync()
        wall = time.perf_counter() - start
        prof.step()  # closes the active window
    kind = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and not _is_annotation(e)]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    span = lambda evs: _covered_us([(e.time_range.start, e.time_range.end) for e in evs]) * 1e-6 / wall if evs else None
    by_name: dict[str, list[float]] = {}  # kernel name -> [device us, calls]
    for e in kernels:
        entry = by_name.setdefault(e.name[:90], [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:25]
    return {"profiled_ms_per_step": 1e3 * wall / steps, "busy_device": "cuda" if on_cuda else "cpu (host ops)",
            "busy_fraction": span(kernels), "busy_fraction_with_copies": span(events),
            "kernels_per_step": len(kernels) / steps,
            "kernel_us_per_step": {name: [round(us / steps, 2), calls / steps] for name, (us, calls) in top}}


def _is_annotation(event) -> bool:
    """Step markers and ``record_function`` ranges, which span work rather than being work."""
    return getattr(event, "is_user_annotation", False) or event.name.startswith("ProfilerStep")


def _covered_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
