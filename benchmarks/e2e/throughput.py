"""End-to-end output tokens/s: hf_paged's ``generate_batch`` against transformers' continuous batching, one run.

Model: a random-init bf16 Llama shaped like Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 kv heads, head_dim
64, vocab 128256, tied embeddings), the same weights in every system and process (seeded init). Greedy.

Workloads (``--workloads``, in this order by default):
  anchor   256 requests, prompts uniform in [128, 1024] random tokens (seed 0), exactly 256 new tokens (no EOS)
  min_new  the anchor with EOS set and min_new_tokens=256 (the sampler's logits-processing path)
  r64      the first 64 anchor prompts
  r1024    1024 prompts, same distribution, seed 0
  latency  batch 1, 512-token prompt: ms per output token of decode alone = (median wall of a 256-new-token call
           - median wall of a 1-new-token call) / 255, five of each; prefill and per-call setup (graph capture
           included) cancel out. Where the system records per-token timestamps (transformers), their mean
           spacing goes in the JSON beside it as a cross-check.
  profile  hf_paged only: an ``hf_paged.Engine`` on the anchor, stepped past every prefill, then 20 decode steps
           timed (ms per step at batch 256) and 20 profiled (GPU busy fraction: kernel time, overlaps merged / wall;
           kernels per step)
  profile1 the same at batch 1 (the latency workload's one 512-token prompt): the kernels of one decode step
  roofline hf_paged only: the anchor through an ``hf_paged.Engine`` (as ``generate_batch`` builds it), timed, then
           again with the whole run under ``torch.profiler``: per phase (prefill / mixed / decode GEMMs and
           attention, KV write, sampler, norms/rotary/elementwise, copies, other, host gaps) the GPU time, the work
           (FLOPs, bytes) and its roofline time at the copy and matrix rates measured on the card in the same run;
           ``benchmarks/e2e/roofline.py`` says how kernels are sorted and the work counted

Systems (``--systems``; all but ``hf_paged_compiled`` and ``hf_paged_cublas`` by default, in this order):
  hf_paged          ``hf_paged.generate_batch``, block_size 16 (eager layers on the layer kernels where they serve)
  hf_paged_eager_layers  the same with ``compile_layers=False, layer_kernels=False``: HF's eager modules around the
                         paged attention
  hf_paged_compiled      the same with ``compile_layers=True, layer_kernels=False``: the layers compiled by torch.compile
  hf_paged_cublas        the same with ``skinny_linear=False``: cuBLAS serves every linear layer
  transformers      ``model.generate_batch`` of the transformers this process imports, default config but the budget
                    (model loaded with sdpa; transformers switches to flash attention when flash-attn is installed
                    and decides CUDA graphs, async batching and compile by itself)
  transformers_box  the same in a subprocess whose PYTHONPATH drops the entry the imported transformers came from:
                    under ``HF_TRANSFORMERS=newest`` that is the box's own release (5.17)

Every system gets the same prompts and the same budget: ``--max-batch-tokens`` (default 8192, transformers' own
default) tokens and ``--max-requests`` (default 256) sequences per step. Time is the wall clock of one call after
a warm-up call of 16 short requests; ``--calls N`` times N calls in a row and reports the first (the figure: the
process's first big call, which also maps the device memory it needs first) and beside it the later calls' median
rate, for every system alike. Each timed call's full collections of Python's garbage collector (host pauses that
would otherwise hide in a figure) go into the row as ``full_collections_s`` (seconds of each, per call) and into its
progress line. A run that fails is reported and the others still run. Progress lines go to stdout as it runs; the
JSON (``--json``) is rewritten after every run, so a killed run keeps what it measured.

    python -m benchmarks.e2e.throughput [--workloads anchor,min_new,r64,r1024,latency,profile,profile1,roofline]
        [--systems hf_paged,transformers,transformers_box] [--json F] [--engine-kwargs '{"block_size": 16}']
        [--max-batch-tokens 8192] [--max-requests 256] [--smoke]
    python -m benchmarks.e2e.throughput --merge a.json b.json [--json merged.json]
    python -m benchmarks.e2e.plot results.json --out results.png

``--engine-kwargs`` (JSON dict) goes to hf_paged only: set as attributes of the continuous-batching config that
``hf_paged.generate_batch`` reads its options from by name (those it does not know are ignored there), and passed
to ``hf_paged.Engine`` for the profile (keys the Engine does not take are listed in the profile row).

``--defaults`` gives neither system any setting: each picks its own budget and cache (hf_paged's automatic sizing;
its start-up line, what it picked and why, goes into the row as ``engine``).

``--sweep`` runs hf_paged alone on one loaded model over ``--sweep-tokens`` (default 2048,4096,8192,16384)
max_batch_tokens x ``--sweep-seqs`` (default 64,128,256,512) max_requests_per_batch, and its automatic choice (no
settings, timed after the grid), on the anchor, the 64-request workload and batch-1 latency (or ``--workloads``): one
warm-up for the whole sweep, one timed call per point (latency: its own pairs of calls), then a table per workload
with the best point and where the automatic choice lands against it (latency: by the per-token timestamps' spacing).
Rows carry the card and versions; the JSON is rewritten after each point.

    python -m benchmarks.e2e.throughput --defaults --systems hf_paged,transformers --workloads anchor,r64,latency
    python -m benchmarks.e2e.throughput --sweep --json sweep.json

``--smoke`` runs every path on a tiny model on the CPU (1/64 of the requests, 1/16 of the prompt lengths, 4 new
tokens, budget 256 tokens / 16 sequences, transformers' cache capped at 32 blocks and its budget kept under
``--defaults``; the sweep's grid 128,256 x 2,4); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import time
import traceback
from pathlib import Path

import torch
import transformers

from benchmarks import comma_names
from benchmarks.e2e.decode_profile import profile_decode
from benchmarks.e2e.other_transformers import run_other_transformers
from benchmarks.e2e.report import PROFILED, make_row, print_table, read_rows, write_json
from benchmarks.e2e.roofline import format_table, run_roofline
from benchmarks.e2e.systems import (
    Budget, EngineSizing, hf_paged_system, timed_latency, timed_throughput, transformers_system, warm_up)
from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, WARM, WORKLOADS, Workload, load_model
import hf_paged

SYSTEMS = ("hf_paged", "hf_paged_eager_layers", "hf_paged_compiled", "hf_paged_cublas", "transformers", "transformers_box")
DEFAULT_SYSTEMS = ("hf_paged", "hf_paged_eager_layers", "transformers", "transformers_box")
# hf_paged variants: the engine options each adds to --engine-kwargs
HF_PAGED_VARIANTS = {"hf_paged": {}, "hf_paged_eager_layers": {"compile_layers": False, "layer_kernels": False},
                     "hf_paged_compiled": {"compile_layers": True, "layer_kernels": False},
                     "hf_paged_cublas": {"skinny_linear": False}}
HF_PAGED_ONLY = PROFILED
SWEEP_WORKLOADS = ("anchor", "r64", "latency")
_DIRECTORIES = re.compile(r"/[^\s:,'\"]*/")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workloads", help="comma list of " + ", ".join(WORKLOADS) + " (default: all; the sweep: "
                        + ", ".join(SWEEP_WORKLOADS) + ")")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    parser.add_argument("--json", help="write every row here (rewritten after each run)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge result files into one table (and --json)")
    parser.add_argument("--engine-kwargs", default="{}", help="JSON dict of hf_paged engine options")
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per step, every system (default 8192)")
    parser.add_argument("--max-requests", type=int, help="sequences per step, every system (default 256)")
    parser.add_argument("--defaults", action="store_true", help="no settings for either system")
    parser.add_argument("--sweep", action="store_true", help="hf_paged over a grid of budgets and its automatic one")
    parser.add_argument("--sweep-tokens", default="2048,4096,8192,16384", help="the sweep's max_batch_tokens")
    parser.add_argument("--sweep-seqs", default="64,128,256,512", help="the sweep's max_requests_per_batch")
    parser.add_argument("--calls", type=int, default=1, help="timed calls per throughput workload (default 1): the "
                        "first is the figure, the later ones' median rate goes beside it")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check every path runs")
    parser.add_argument("--as-subprocess", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workloads = comma_names(args.workloads or ",".join(SWEEP_WORKLOADS if args.sweep else WORKLOADS), WORKLOADS,
                            "--workloads")
    args.systems = comma_names(args.systems, SYSTEMS, "--systems")
    args.engine_kwargs = json.loads(args.engine_kwargs)
    if not isinstance(args.engine_kwargs, dict):
        parser.error("--engine-kwargs must be a JSON object, e.g. '{\"block_size\": 32}'")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        rows = read_rows(args.merge)
        print_table(rows)
        print_roofline_tables(rows)
        if args.json:
            write_json(args.json, rows, merged_from=[Path(p).name for p in args.merge])
        return
    if args.smoke:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and they thrash on a shared machine
    # transformers' continuous batching warns on every call that the request has no EOS; errors still show
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    workloads = [WORKLOADS[name].smoke() if args.smoke else WORKLOADS[name] for name in args.workloads]
    if args.sweep:
        run_sweep(args, workloads, Progress())
        return
    budget = Budget(args.max_batch_tokens or (256 if args.smoke else 8192),
                    args.max_requests or (16 if args.smoke else 256))
    if args.defaults:
        budget = Budget(args.max_batch_tokens, args.max_requests)
    plan = {s: [w for w in workloads if s in HF_PAGED_VARIANTS or w.name not in HF_PAGED_ONLY] for s in args.systems}
    log = Progress(prefix="  (subprocess) " if args.as_subprocess else "")
    if not args.as_subprocess:
        log(f"runs, in order: " + "; ".join(f"{s}: {', '.join(w.name for w in ws)}" for s, ws in plan.items() if ws))
        log(f"budget: {budget.max_batch_tokens} tokens, {budget.max_requests} sequences per step; "
            f"engine kwargs {args.engine_kwargs}; torch {torch.__version__}, transformers {transformers.__version__}")
    rows: list[dict] = []
    meta = {"systems": args.systems, "workloads": {w.name: w.description for w in workloads}}

    def save() -> None:
        if args.json:
            write_json(args.json, rows, **meta)

    for system, system_workloads in plan.items():
        if not system_workloads:
            continue
        if system == "transformers_box":
            rows += run_other_transformers(__spec__.name, _child_args(args, budget, system_workloads),
                                           [w.name for w in system_workloads], log)
            save()
            continue
        for row in run_system(system, system_workloads, args, budget, log):
            rows.append(row)
            save()
    if not args.as_subprocess:
        print_table(rows)
        print_roofline_tables(rows)


def print_roofline_tables(rows: list[dict]) -> None:
    for row in rows:
        if row["workload"] == "roofline" and row["status"] != "failed":
            print("\n" + format_table(row), flush=True)


def run_system(system: str, workloads: list[Workload], args: argparse.Namespace, budget: Budget, log):
    """Load the model once for the system, then yield one row per workload."""
    shape, device = (SMOKE_SHAPE, "cpu") if args.smoke else (LLAMA_1B, "cuda")
    ours = system in HF_PAGED_VARIANTS
    engine_kwargs = {**args.engine_kwargs, **HF_PAGED_VARIANTS[system]} if ours else {}
    label = system if ours else f"transformers {transformers.__version__}"
    if not ours and args.smoke and budget.is_default:
        budget = Budget(256, 16)  # on the CPU transformers would size its cache and warm-up from the RAM
    settings = {"budget": vars(budget), "smoke": args.smoke, "engine_kwargs": engine_kwargs,
                "defaults": args.defaults}
    try:
        model = load_model(shape, device, hf_paged.ATTN_IMPLEMENTATION if ours else "sdpa")
    except Exception as exc:  # e.g. out of memory: report, keep the other systems
        for w in workloads:
            yield make_row(system, label, w.name, error=_error(exc), **settings)
        return
    generate = (hf_paged_system(model, budget, engine_kwargs) if ours
                else transformers_system(model, budget, num_blocks=32 if args.smoke else None))
    vocab, warm = shape["vocab_size"], WARM.smoke() if args.smoke else WARM
    reps, steps = (1, 5) if args.smoke else (5, 20)
    for w in workloads:
        log(f"{label} / {w.name}: {w.num_sent} requests, {w.new_tokens} new tokens ...")
        start = time.perf_counter()
        try:
            with EngineSizing() as sizing:
                if w.name in ("profile", "profile1"):
                    result = profile_decode(model, w, budget, engine_kwargs, vocab, steps=steps)
                elif w.name == "roofline":
                    warm_up(model, generate, warm.prompts(vocab), warm.generation_config())
                    result = run_roofline(model, w, budget, engine_kwargs, vocab, smoke=args.smoke)
                elif w.is_latency:
                    result = timed_latency(model, generate, w, vocab, reps=reps)
                else:
                    result = timed_throughput(model, generate, w, vocab, warm, calls=args.calls)
            if ours:
                result = {**result, "engine": sizing.last}
            row = make_row(system, label, w.name, result, **settings)
        except Exception as exc:  # a system that cannot run a workload is reported; the others still run
            traceback.print_exc(limit=-3)
            row = make_row(system, label, w.name, error=_error(exc), **settings)
        log(f"{label} / {w.name}: {_summary(row)} (with warm-up {time.perf_counter() - start:.1f} s)")
        _release()  # the run's KV pool and graphs, before the next one sizes its own from free memory
        yield row
    del model, generate
    _release()


def run_sweep(args: argparse.Namespace, workloads: list[Workload], log) -> list[dict]:
    """hf_paged on one loaded model over the grid of budgets and its automatic choice, one timed call per point and
    workload after one warm-up for the whole sweep; a table per workload."""
    shape, device = (SMOKE_SHAPE, "cpu") if args.smoke else (LLAMA_1B, "cuda")
    tokens = [int(t) for t in ("128,256" if args.smoke else args.sweep_tokens).split(",")]
    seqs = [int(n) for n in ("2,4" if args.smoke else args.sweep_seqs).split(",")]
    # the automatic choice last: the first timed point after the warm-up ran 7% below the same budget set by hand,
    # later in the same sweep (H200, 2026-11-28: 39.4k against 42.3k tok/s at 16384 x 256)
    points = [Budget(t, n) for t in tokens for n in seqs] + [Budget(None, None)]
    log(f"sweep: {len(points)} points (automatic last) x {', '.join(w.name for w in workloads)}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}")
    model = load_model(shape, device, hf_paged.ATTN_IMPLEMENTATION)
    vocab, warm = shape["vocab_size"], WARM.smoke() if args.smoke else WARM
    reps = 1 if args.smoke else 3
    warm_up(model, hf_paged_system(model, Budget(max(tokens), max(seqs)), args.engine_kwargs),
            warm.prompts(vocab), warm.generation_config())  # compiles once for every point
    rows: list[dict] = []
    for w in workloads:
        for budget in points:
            label = ("hf_paged auto" if budget.is_default
                     else f"hf_paged {budget.max_batch_tokens}x{budget.max_requests}")
            generate = hf_paged_system(model, budget, args.engine_kwargs)
            try:
                with EngineSizing() as sizing:
                    result = (timed_latency(model, generate, w, vocab, reps=reps) if w.is_latency
                              else timed_throughput(model, generate, w, vocab, None))
                row = make_row("hf_paged", label, w.name, {**result, "engine": sizing.last}, budget=vars(budget),
                               smoke=args.smoke, engine_kwargs=args.engine_kwargs, sweep=True)
            except Exception as exc:  # noqa: BLE001 - one point failing (out of memory) must not end the sweep
                row = make_row("hf_paged", label, w.name, error=_error(exc), budget=vars(budget), sweep=True)
            log(f"{label} / {w.name}: {_summary(row) if row['status'] != 'failed' else row['error']}")
            rows.append(row)
            _release()
            if args.json:
                write_json(args.json, rows, sweep={"tokens": tokens, "seqs": seqs,
                                                   "workloads": {w.name: w.description for w in workloads}})
    print(sweep_table(rows))
    return rows


def sweep_table(rows: list[dict]) -> str:
    """Per workload: every point's figure, the best point, and the automatic choice against the best."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ok = [r for r in rows if r["workload"] == workload and r["status"] != "failed"]
        if not ok:
            continue
        latency = workload == "latency"
        # latency: the mean spacing of the per-token timestamps where the row has them (a call's decode alone; the
        # difference of two calls' medians swings by 8% between neighbouring points), else that difference
        value = ((lambda r: r.get("ms_per_token_timestamps") or r["ms_per_token"]) if latency
                 else (lambda r: r["tok_per_s"] or 0.0))
        best = (min if latency else max)(ok, key=value)
        lines.append(f"{workload} ({'ms per output token' if latency else 'output tok/s'}):")
        for r in ok:
            mark = " <- best" if r is best else ""
            lines.append(f"  {r['label']:<24} {value(r):>12,.2f}{mark}")
        auto = next((r for r in ok if r["label"] == "hf_paged auto"), None)
        if auto is not None:
            ratio = value(best) / value(auto) if latency else value(auto) / value(best)
            picked = re.findall(r"(max_batch_tokens=\d+|max_num_seqs=\d+)", auto.get("engine") or "")
            lines.append(f"  automatic / best: {ratio:.3f} (automatic: {', '.join(picked) or 'not seen'})")
    return "\n".join(lines)


class Progress:
    """Flushed progress lines stamped with the seconds since the start."""

    def __init__(self, prefix: str = ""):
        self.start, self.prefix = time.perf_counter(), prefix

    def __call__(self, message: str) -> None:
        print(f"{self.prefix}[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summary(row: dict) -> str:
    if row["status"] == "failed":
        return f"FAILED: {row['error']}"
    return f"{_result(row)}, attention {row.get('attention') or row.get('decode_backend')}"


def _result(row: dict) -> str:
    if row["workload"] == "latency":
        stamps = row["ms_per_token_timestamps"]
        stamps = f", {stamps:.2f} ms from its per-token timestamps" if stamps else ""
        return f"{row['ms_per_token']:.2f} ms per output token{stamps} ({row['status']})"
    if row["tok_per_s"] is None:
        return f"{row['tokens']:,} tokens, {row['seconds']:.3f} s: no rate ({row['status']})"
    text = f"{row['tokens']:,} tokens in {row['seconds']:.2f} s = {row['tok_per_s']:,.0f} tok/s ({row['status']})"
    if row.get("later_tok_per_s"):
        text += f"; later calls {row['later_tok_per_s']:,.0f} tok/s"
    pauses = [(i, sum(p)) for i, p in enumerate(row.get("full_collections_s") or []) if p]
    if pauses:
        text += "; full collections of the collector inside: " + ", ".join(f"{s:.2f} s in call {i + 1}"
                                                                           for i, s in pauses)
    if row["workload"] == "roofline":
        total = row["total"]
        text += (f"; GPU kernels {total['gpu_ms']:.0f} ms against a roofline of {total['roofline_ms']:.0f} ms "
                 f"({total['wall_ms']:.0f} ms wall profiled)")
    if row["workload"] in ("profile", "profile1"):
        busy = row["busy_fraction"]
        text += f", {row['ms_per_step']:.2f} ms per step at batch {row['batch']}, busy " + (
            "n/a" if busy is None else f"{busy:.0%}")
    return text


def _child_args(args: argparse.Namespace, budget: Budget, workloads: list[Workload]) -> list[str]:
    child = ["--systems", "transformers", "--workloads", ",".join(w.name for w in workloads)]
    if budget.max_batch_tokens is not None:
        child += ["--max-batch-tokens", str(budget.max_batch_tokens)]
    if budget.max_requests is not None:
        child += ["--max-requests", str(budget.max_requests)]
    return child + ["--as-subprocess"] + (["--smoke"] if args.smoke else []) + (["--defaults"] if args.defaults
                                                                                 else [])


def _error(exc: BaseException) -> str:
    """The exception in one line, without the machine's directories (the JSON may be committed)."""
    return f"{type(exc).__name__}: {_DIRECTORIES.sub('', str(exc))[:300]}"


if __name__ == "__main__":
    main()
