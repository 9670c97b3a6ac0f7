"""Plain ``model.generate`` latency: ms per decode step of each attention / cache setup, in one run.

Model: a random-init bf16 Llama shaped like Llama-3.2-1B (``benchmarks.e2e.workloads.LLAMA_1B``), the same weights in
every system. Workload: ``--batches`` (default 1, 16, 64) rows of left-padded random prompts, lengths uniform in
[256, 768] (seed 0), ``--new-tokens`` (default 128) new tokens each (no EOS), greedy.

Systems (``--systems``, in this order by default):
  sdpa               attn_implementation="sdpa", generate's DynamicCache
  flash_attention_2  attn_implementation="flash_attention_2", DynamicCache (skipped where flash-attn is missing)
  hf_paged           attn_implementation="hf_paged", PagedAttentionCache (eager decode)
  hf_paged_compiled  the same with PagedAttentionCache(max_new_tokens=...): generate compiles its decode step
  static             sdpa with cache_implementation="static": generate compiles its decode step
  hf_paged_compiled_skinny  hf_paged_compiled with the engine's decode linears (CUDA only): hf_paged's skinny
                     kernel, q/k/v and gate/up grouped into one launch each by an inductor pass (put together
                     by hand: hf_paged_optimized is the public way)
  hf_paged_optimized hf_paged_compiled after ``hf_paged.optimize_generate(model)``: planned masks, no guards on
                     nn modules, the skinny decode linears grouped where they serve (CUDA)

``--guard-filter inbuilt|all`` drops dynamo's guards on (built-in | all) nn modules from every compiled system's
step: ~3,400 guards for 16 layers are evaluated before each compiled call (the same for both caches).
``--skip-guard-eval`` runs every compiled system's calls after its first (compiling) one under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: dynamo then evaluates only the guards that tell its
compiled graphs apart ("unsafe": a call that needs a new graph may run an old one; the timed calls never do).

ms per decode step = (median wall of a ``new_tokens`` call - median wall of a 1-new-token call) / (new_tokens - 1)
over ``--repeats`` calls each, after a first call; prefill and per-call setup cancel out. ``one_token_call_s`` is the
median 1-new-token call (the prompt forward and a call's setup), ``ms_per_token_all_in`` the median ``new_tokens``
call over its tokens (everything a caller waits for). ``first_call_s`` is the
wall of the first call (compile and CUDA-graph capture included for the compiled systems), ``compile_s`` that
minus a warm call's and ``graphs`` the graphs torch.compile made (0: generate did not compile). Inductor's on-disk
graph cache is off, so each compiled system compiles from scratch.
The paged systems reuse one ``PagedAttentionCache`` across their calls unless ``--fresh-cache`` gives each call a new
one (a user's ``generate`` call builds its own: the cache's set-up and the first step's work on a new cache then count
in every call, ``ms_per_token_all_in`` above all). ``tokens_match`` counts the rows whose tokens equal hf_paged
eager's (bf16: a near-tie may flip a token).
Progress lines go to stdout as it runs; the JSON (``--json``) is rewritten after every run. ``--isolate`` runs each
system at each batch size in a fresh process (one run's compiled code, allocator state or first-compile imports
then cannot reach the next; each run loads its model anew).

    python -m benchmarks.generate.latency [--batches 1,16,64] [--systems ...] [--new-tokens 128]
        [--block-size 16] [--repeats 3] [--fresh-cache] [--isolate] [--json F] [--markdown F] [--smoke]

``--smoke`` runs every path on a tiny model on the CPU (batches 1 and 2, prompts of 8 to 24 tokens, 6 new tokens;
the compiled systems compile with ``--compile-backend``, default "eager" there); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch._dynamo.utils import counters
import torch._inductor.config

from benchmarks import child_env, module_command
from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, load_model
from benchmarks.generate.systems import (  # noqa: F401  (the other generate benchmarks take these from here too)

    ATTN, COMPILED, GUARD_FILTERS, SYSTEMS, generate_call, prompts, skip_reason)
from hf_paged.bench import run_header


def timed(call, k: int, sync) -> tuple[float, torch.Tensor]:
    sync()
    start = time.perf_counter()
    out = call(k)
    sync()
    return time.perf_counter() - start, out


def measure(system: str, model, batch: dict, args: argparse.Namespace, sync) -> dict:
    """One system at one batch size: first-call time, ms per decode step, the last call's tokens."""
    torch._dynamo.reset()  # each compiled system compiles from scratch, within the recompile limit
    call = generate_call(system, model, batch, args)
    graphs = counters["stats"]["unique_graphs"]
    first, _ = timed(call, args.new_tokens, sync)
    graphs = counters["stats"]["unique_graphs"] - graphs
    full, one, out = [], [], None
    for _ in range(args.repeats):
        seconds, out = timed(call, args.new_tokens, sync)
        full.append(seconds)
        one.append(timed(call, 1, sync)[0])
    step_ms = (statistics.median(full) - statistics.median(one)) / (args.new_tokens - 1) * 1e3
    row = {"status": "ok", "ms_per_step": round(step_ms, 3), "first_call_s": round(first, 3),
           "warm_call_s": round(statistics.median(full), 3), "one_token_call_s": round(statistics.median(one), 4),
           "ms_per_token_all_in": round(statistics.median(full) / args.new_tokens * 1e3, 3)}
    if system in COMPILED:
        row.update(compile_s=round(first - statistics.median(full), 3), graphs=graphs)
    return {**row, "tokens": out[:, batch["input_ids"].shape[1]:].cpu()}


def run_one(system: str, batch_size: int, args: argparse.Namespace, models: dict, device: str, shape: dict,
            sync) -> tuple[dict, torch.Tensor | None]:
    """One system at one batch size in this process (models loaded once per attention implementation): the row's
    results and the tokens, or a failed status and None."""
    try:
        attn = ATTN[system]
        if attn not in models:
            models[attn] = load_model(shape, device, attn)
        batch = prompts(batch_size, args.lengths, shape["vocab_size"], device)
        result = measure(system, models[attn], batch, args, sync)
        return result, result.pop("tokens")
    except Exception as err:  # noqa: BLE001 - one failing system must not lose the others' numbers
        traceback.print_exc()
        return {"status": f"failed: {type(err).__name__}: {err}"}, None


def run_isolated(system: str, batch_size: int, args: argparse.Namespace) -> tuple[dict, torch.Tensor | None]:
    """``run_one`` in a process of its own (``--isolate``): no run inherits another's compiled code, allocator
    state or first-compile imports."""
    passed = ["--new-tokens", str(args.new_tokens), "--block-size", str(args.block_size), "--repeats",
              str(args.repeats), "--guard-filter", args.guard_filter]
    passed += ["--compile-backend", args.compile_backend] if args.compile_backend else []
    passed += ["--skip-guard-eval"] * args.skip_guard_eval + ["--smoke"] * args.smoke
    passed += ["--fresh-cache"] * args.fresh_cache
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.pt"
        child = subprocess.run(module_command(__spec__.name, "--systems", system, "--batches", str(batch_size),
                                              *passed, "--child-out", str(out)),
                               env=child_env(), capture_output=True, text=True)
        if child.returncode != 0 or not out.exists():
            sys.stdout.write(child.stdout[-2000:] + child.stderr[-4000:])
            last = (child.stderr.strip().splitlines() or ["no output"])[-1]
            return {"status": f"failed: the run's process exited with {child.returncode}: {last}"}, None
        result = torch.load(out)
        return result["row"], result["tokens"]


def write_json(args: argparse.Namespace, rows: list[dict], tokens: dict) -> None:
    """Rows so far, each with how many of its rows' tokens equal hf_paged eager's (once that has run)."""
    for row in rows:
        reference, own = tokens.get(("hf_paged", row["batch"])), tokens.get((row["system"], row["batch"]))
        if reference is not None and own is not None:
            row["tokens_match"] = int((own == reference).all(1).sum())
    if args.json is not None:
        # output paths by name only: the file may be committed, the machine's directories are not its business
        settings = {k: (v.name if isinstance(v, Path) else str(v)) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))


def table(rows: list[dict], systems: list[str], batches: list[int]) -> str:
    """Markdown: ms per decode step per system (columns) and batch (rows), then first-call seconds."""
    cell = {(r["system"], r["batch"]): r for r in rows}

    def fmt(system: str, batch: int, key: str) -> str:
        r = cell.get((system, batch))
        if r is None or r["status"] != "ok":
            return "-" if r is None else r["status"].split(":")[0]
        return f"{r[key]:.2f}" if key in r else ""

    lines = ["| batch | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    lines += [f"| {b} | " + " | ".join(fmt(s, b, "ms_per_step") for s in systems) + " |" for b in batches]
    lines += ["", "first call (s, compile included): | batch | " + " | ".join(systems) + " |"]
    lines += [f"| {b} | " + " | ".join(fmt(s, b, "first_call_s") for s in systems) + " |" for b in batches]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (default 128)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedAttentionCache block size")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls of each length (default 3)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend of the compiled systems (default: generate's own choice on "
                             "CUDA, 'eager' with --smoke)")
    parser.add_argument("--guard-filter", choices=sorted(GUARD_FILTERS), default="none",
                        help="skip dynamo's guards on nn modules in every compiled system: none (default), inbuilt "
                             "(torch.nn modules), all")
    parser.add_argument("--skip-guard-eval", action="store_true",
                        help="after each compiled system's first call, evaluate only the guards that tell its "
                             "graphs apart (torch.compiler.set_stance(skip_guard_eval_unsafe=True))")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="a new PagedAttentionCache for every call (as users make one per call) instead of one "
                             "cache every call of a system reuses")
    parser.add_argument("--isolate", action="store_true",
                        help="run each system at each batch size in a process of its own")
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)  # --isolate's runs
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here too")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check every path runs")
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.batches = [int(b) for b in (args.batches or ("1,2" if smoke else "1,16,64")).split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    args.new_tokens = args.new_tokens or (6 if smoke else 128)
    args.repeats = args.repeats or (1 if smoke else 3)
    args.lengths = (8, 24) if smoke else (256, 768)
    if smoke and args.compile_backend is None:
        args.compile_backend = "eager"
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU; --smoke runs every path on the CPU")
    if args.smoke:
        torch.set_num_threads(min(4, torch.get_num_threads()))
    torch._inductor.config.fx_graph_cache = False
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    shape = SMOKE_SHAPE if args.smoke else LLAMA_1B
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    runs = [(s, b) for b in args.batches for s in args.systems]
    print(f"generate latency on {where}, torch {torch.__version__}; {len(runs)} runs, in order: "
          + "; ".join(f"batch {b}: {', '.join(args.systems)}" for b in args.batches), flush=True)
    rows, models, tokens = [], {}, {}
    for i, (system, batch_size) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {system}, batch {batch_size} ...", flush=True)
        row = {"system": system, "batch": batch_size, "new_tokens": args.new_tokens, "device": where,
               **run_header(device)}
        reason = skip_reason(system, device)
        if reason is not None:
            rows.append({**row, "status": f"skipped: {reason}"})
            print(f"    skipped: {reason}", flush=True)
            write_json(args, rows, tokens)
            continue
        if args.isolate:
            result, own = run_isolated(system, batch_size, args)
        else:
            result, own = run_one(system, batch_size, args, models, device, shape, sync)
        row.update(result)
        if own is not None:
            tokens[system, batch_size] = own
            print(f"    {row['ms_per_step']:.3f} ms/step, first call {row['first_call_s']:.2f} s", flush=True)
        else:
            print(f"    {row['status']}", flush=True)
        rows.append(row)
        write_json(args, rows, tokens)
        if args.child_out is not None:
            torch.save({"row": result, "tokens": own}, args.child_out)
    text = table(rows, args.systems, args.batches)
    print(f"ms per decode step ({where}, Llama-1B-shaped, prompts {args.lengths[0]}-{args.lengths[1]}, "
          f"{args.new_tokens} new tokens, greedy)\n{text}")
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
