"""The anchor workload several times in one process, plus the steady-decode profile: for A/B runs of two checkouts.

On a shared host one anchor run varies by about 10% from run to run (the timed call builds its engine, so CUDA-graph
capture and host noise are inside it). This script loads the model and compiles once, then times ``--reps`` fresh
``generate_batch`` calls on the anchor (hf_paged only, the benchmark's own system and budget), and profiles 20 steady
decode steps at batch 256 (ms per step, GPU busy fraction). To compare two checkouts, run it from each in turn,
alternating, and compare medians:

    for d in old new old new; do (cd $d && python -m benchmarks.e2e.anchor_repeat --tag $d --json $d.json); done
    python -m benchmarks.e2e.anchor_repeat --table old*.json new*.json

The JSON holds the tag (name it after the checkout), the card, each rate, their median and the profile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def measure(tag: str, reps: int, engine_kwargs: dict) -> dict:
    import torch

    from benchmarks.e2e.decode_profile import profile_decode
    from benchmarks.e2e.systems import Budget, _num_generated, _timed_call, hf_paged_system, warm_up
    from benchmarks.e2e.workloads import LLAMA_1B, WARM, WORKLOADS, load_model
    from hf_paged.bench import run_header

    start = time.perf_counter()
    model = load_model(LLAMA_1B, "cuda", "hf_paged")
    budget = Budget(8192, 256)
    generate = hf_paged_system(model, budget, engine_kwargs)
    workload, vocab = WORKLOADS["anchor"], LLAMA_1B["vocab_size"]
    prompts = workload.prompts(vocab)
    warm_up(model, generate, WARM.prompts(vocab), WARM.generation_config())
    print(f"[{tag}] loaded and warmed up in {time.perf_counter() - start:.0f} s", flush=True)
    rates = []
    for _ in range(reps):
        seconds, out = _timed_call(generate, prompts, workload.generation_config())
        rates.append(_num_generated(out) / seconds)
        print(f"[{tag}] anchor: {_num_generated(out):,} tokens in {seconds:.3f} s = {rates[-1]:,.0f} tok/s", flush=True)
    profile = profile_decode(model, workload, budget, engine_kwargs, vocab)
    print(f"[{tag}] steady decode: {profile['ms_per_step']:.3f} ms/step at batch {profile['batch']}, "
          f"GPU busy {profile['busy_fraction']:.3f}", flush=True)
    return {"tag": tag, **run_header(), "engine_kwargs": engine_kwargs, "rates": rates,
            "median": statistics.median(rates), "decode_ms_per_step": profile["ms_per_step"],
            "busy_fraction": profile["busy_fraction"], "batch": profile["batch"]}


def table(paths: list[str]) -> None:
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows.extend(data["rows"] if "rows" in data else [data])
    print(f"{'run':<10} {'median tok/s':>13} {'min':>8} {'max':>8} {'decode ms/step':>15} {'busy':>6}")
    for row in rows:
        ms, busy = row.get("decode_ms_per_step"), row.get("busy_fraction")
        print(f"{row['tag']:<10} {row['median']:>13,.0f} {min(row['rates']):>8,.0f} {max(row['rates']):>8,.0f} "
              f"{'-' if ms is None else f'{ms:.3f}':>15} {'-' if busy is None else f'{busy:.3f}':>6}")
    by_tag: dict[str, list[float]] = {}
    for row in rows:
        by_tag.setdefault(row["tag"].rstrip("0123456789"), []).extend(row["rates"])
    for tag, rates in by_tag.items():
        print(f"{tag}: median of {len(rates)} runs {statistics.median(rates):,.0f} tok/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default="run", help="name of this run in the JSON and the table")
    parser.add_argument("--reps", type=int, default=3, help="timed anchor calls (default 3)")
    parser.add_argument("--engine-kwargs", default="{}", help="JSON dict of hf_paged engine options")
    parser.add_argument("--json", help="write the run's row here")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print a table of earlier runs and exit")
    args = parser.parse_args(argv)
    if args.table:
        table(args.table)
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the anchor is a 1B model with 256 requests")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    row = measure(args.tag, args.reps, json.loads(args.engine_kwargs))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
