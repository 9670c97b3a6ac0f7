"""Where a compiled ``generate`` decode step's time goes, on the GPU: host parts and GPU busy time per step.

For each system of ``benchmarks/generate/latency.py`` (same model, prompts and compile configs, ``--guard-filter``
included):
  ms_per_step      as generate_latency measures it (median of 3, a 128-token call minus a 1-token call)
  prepare_us       median host time of ``prepare_inputs_for_generation`` per decode step (for a compileable cache
                   this builds the step's mask: hf_paged plans the step there)
  compiled_us      median host time of the compiled call per decode step, until it returns (dynamo's guards, the
                   runtime wrappers, the CUDA-graph launch, output bookkeeping)
  gpu_busy_ms      kernel time per decode step (union of the kernels' intervals, torch profiler) over one call
  kernels          kernels per decode step
``generate`` synchronizes on every step (its stopping check), so with CUDA graphs a step takes about the GPU's busy
time plus the host time before the graph launches; ``ms_per_step - gpu_busy_ms`` is the time the GPU waits.

    python -m benchmarks.generate.step_parts [--systems hf_paged_compiled,static] [--batch 1] [--guard-filter all]
        [--skip-guard-eval]
        [--json F]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.e2e.decode_profile import _covered_us
from benchmarks.e2e.workloads import LLAMA_1B, load_model
from benchmarks.generate import latency
from hf_paged.bench import run_header

NEW_TOKENS = 128


def host_parts(model, call) -> tuple[float, float]:
    """Median host microseconds per decode step of ``prepare_inputs_for_generation`` and of the compiled call."""
    prepare_times, compiled_times = [], []
    prepare, get_compiled = model.prepare_inputs_for_generation, model.get_compiled_call

    @functools.wraps(prepare)  # generate validates its kwargs against this signature
    def timed_prepare(*args, **kwargs):
        start = time.perf_counter()
        out = prepare(*args, **kwargs)
        prepare_times.append(time.perf_counter() - start)
        return out

    def timed_get_compiled(compile_config):
        compiled = get_compiled(compile_config)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = compiled(*args, **kwargs)
            compiled_times.append(time.perf_counter() - start)
            return out

        return timed

    own = {name: model.__dict__[name] for name in ("prepare_inputs_for_generation", "get_compiled_call")
           if name in model.__dict__}  # optimize_generate sets its own get_compiled_call
    model.prepare_inputs_for_generation, model.get_compiled_call = timed_prepare, timed_get_compiled
    try:
        call(NEW_TOKENS)
        torch.cuda.synchronize()
    finally:
        del model.prepare_inputs_for_generation, model.get_compiled_call
        model.__dict__.update(own)
    if len(compiled_times) < NEW_TOKENS - 1:
        raise RuntimeError(f"only {len(compiled_times)} of {NEW_TOKENS - 1} decode steps ran compiled")
    return 1e6 * statistics.median(prepare_times[1:]), 1e6 * statistics.median(compiled_times)


def gpu_busy(call) -> tuple[float, float]:
    """Kernel milliseconds and kernels per decode step over one call (prefill's share subtracted by a 1-token
    call profiled the same way)."""
    def busy(new_tokens: int) -> tuple[float, int]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call(new_tokens)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return _covered_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3, len(kernels)

    (full_ms, full_n), (one_ms, one_n) = busy(NEW_TOKENS), busy(1)
    steps = NEW_TOKENS - 1
    return (full_ms - one_ms) / steps, (full_n - one_n) / steps


def measure(system: str, model, batch: dict, args: argparse.Namespace) -> dict:
    """One system: ms per step, then the host parts, then the GPU busy time (``args``: generate_latency's)."""
    torch._dynamo.reset()
    call = latency.generate_call(system, model, batch, args)
    for _ in range(3):  # compile, capture, warm
        call(NEW_TOKENS)
    steps = []
    for _ in range(3):
        full, _ = latency.timed(call, NEW_TOKENS, torch.cuda.synchronize)
        one, _ = latency.timed(call, 1, torch.cuda.synchronize)
        steps.append((full - one) / (NEW_TOKENS - 1) * 1e3)
    prepare_us, compiled_us = host_parts(model, call)
    busy_ms, kernels = gpu_busy(call)
    ms = statistics.median(steps)
    return {"system": system, "batch": batch["input_ids"].shape[0], "guard_filter": args.guard_filter,
            "skip_guard_eval": args.skip_guard_eval, "ms_per_step": round(ms, 3),
            "prepare_us": round(prepare_us), "compiled_us": round(compiled_us), "gpu_busy_ms": round(busy_ms, 3),
            "gpu_waits_ms": round(ms - busy_ms, 3), "kernels": round(kernels)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="hf_paged_compiled,static")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--guard-filter", choices=sorted(latency.GUARD_FILTERS), default="none")
    parser.add_argument("--skip-guard-eval", action="store_true", help="as benchmarks/generate/latency.py's")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the host parts it measures are those of a graph-replayed step)")
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in latency.COMPILED]
    if unknown:
        parser.error(f"not compiled systems: {unknown}; choose from {latency.COMPILED}")
    settings = latency.parse_args(["--new-tokens", str(NEW_TOKENS), "--guard-filter", args.guard_filter]
                                  + ["--skip-guard-eval"] * args.skip_guard_eval)
    rows, models = [], {}
    for system in systems:
        attn = latency.ATTN[system]
        if attn not in models:
            models.clear()
            models[attn] = load_model(LLAMA_1B, "cuda", attn)
        batch = latency.prompts(args.batch, settings.lengths, LLAMA_1B["vocab_size"], "cuda")
        rows.append(measure(system, models[attn], batch, settings))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({**run_header(), "rows": rows}, indent=1))
    keys = ["ms_per_step", "gpu_busy_ms", "gpu_waits_ms", "prepare_us", "compiled_us", "kernels"]
    print(f"\n{torch.cuda.get_device_name()}, batch {args.batch}, guard filter {args.guard_filter}, skip guard eval "
          f"{args.skip_guard_eval}")
    print("| system | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for row in rows:
        print(f"| {row['system']} | " + " | ".join(str(row[k]) for k in keys) + " |")
    return rows


if __name__ == "__main__":
    main()
