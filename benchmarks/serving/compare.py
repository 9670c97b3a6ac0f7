"""``hf-paged serve`` against ``transformers serve`` (continuous batching on): the same checkpoint, the same load.

Each system in turn: its server starts as a subprocess on a free loopback port, a warm-up load runs (``--clients``
requests of other prompts, so neither compiles, captures or fills a prefix cache inside the timed load), then the
timed load: the anchor workload's prompts as text, in order, from ``--clients`` concurrent streaming clients,
greedy, ``--max-tokens`` each; then the server gets SIGTERM. Reports output tokens/s over the whole load and TTFT /
TPOT p50/p99 per system, checks that every request read back its intended prompt length and ran to exactly
``--max-tokens`` tokens, and prints a table (and ``--json``). Each system has ``--system-timeout`` seconds and the
whole run ``--total-timeout``; a system out of time is stopped and reported as such.

    python -m benchmarks.serving.compare --json serve_compare.json              # a GPU: the 1B model, 64 clients
    python -m benchmarks.serving.compare --smoke --requests 4 --clients 2       # the CPU: the tiny model

The checkpoint (``benchmarks/serving/model.py``) is built in a subprocess into ``--model-dir`` unless it is there
already.
``transformers serve`` is started from ``transformers.cli.serve`` of the transformers this Python imports.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import ROOT, child_env, module_command
from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, WARM, WORKLOADS
from benchmarks.serving.load import drive
from benchmarks.serving.model import is_built, prompt_text
from benchmarks.serving.server import ServerProcess, free_port

TRANSFORMERS_SERVE = ("import sys, typer; from transformers.cli.serve import Serve; "
                      "sys.argv[0] = 'transformers serve'; typer.run(Serve)")
# The e2e benchmark's budget where the CLI has a flag for it: 8192 tokens per step (256 sequences for hf_paged)
DEFAULT_ARGS = {
    "hf_paged": "--num-blocks 0 --max-batch-tokens 8192 --max-num-seqs 256",
    "transformers": "--cb-max-batch-tokens 8192",
}
SMOKE_ARGS = {
    "hf_paged": "--device cpu --num-blocks 256 --max-batch-tokens 256",
    "transformers": "--device cpu --cb-num-blocks 16 --cb-max-batch-tokens 256",
}


def server_command(system: str, model_dir: Path, port: int, extra: list[str]) -> tuple[list[str], str]:
    """The server's command line and the model name its requests must carry."""
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if system == "hf_paged":
        name = model_dir.name
        return [sys.executable, "-m", "hf_paged", "serve", "--model", str(model_dir), "--served-model-name", name,
                "--shutdown-timeout", "5", *where, *extra], name
    # transformers serve answers to the name it preloaded (not read from its /v1/models: 5.17 fails it without
    # a hub cache)
    return [sys.executable, "-c", TRANSFORMERS_SERVE, str(model_dir), "--continuous-batching", *where, *extra], \
        str(model_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="hf_paged,transformers", help="comma-separated, run in this order")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, help="the first N anchor prompts (default: all 256; up to 1024 takes "
                                                "the 1024-request draw)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default: 256; --smoke: 8)")
    p.add_argument("--warmup-tokens", type=int, help="new tokens per warm-up request (default: --max-tokens, so "
                                                     "the first request a server sees asks what the timed ones do)")
    p.add_argument("--model-dir", type=Path, help="checkpoint folder, built there if missing (default: one in the "
                                                  "temporary directory)")
    p.add_argument("--smoke", action="store_true", help="the tiny model and scaled-down prompts, on the CPU")
    p.add_argument("--hf-paged-args", default="", help="more `hf-paged serve` flags, after the defaults (with '=': "
                                                        "--hf-paged-args='--flag value')")
    p.add_argument("--transformers-args", default="", help="more `transformers serve` flags, after the defaults "
                                                           "(--transformers-args='...')")
    p.add_argument("--system-timeout", type=float, default=240.0, help="seconds one system may take, start to stop")
    p.add_argument("--total-timeout", type=float, default=560.0, help="seconds the whole run may take")
    p.add_argument("--log-dir", type=Path, help="server logs (default: beside --json, else a temporary folder)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(DEFAULT_ARGS)
    if unknown or not args.systems:
        p.error(f"--systems: choose from {', '.join(DEFAULT_ARGS)} (got {args.systems})")
    args.max_tokens = args.max_tokens or (8 if args.smoke else 256)
    args.warmup_tokens = args.warmup_tokens or args.max_tokens
    return args


def prompts(args: argparse.Namespace) -> tuple[list[str], list[str], list[int]]:
    """The timed prompts, the warm-up prompts (another draw, same lengths' range) and the timed prompts' lengths."""
    requests = args.requests or 256
    workload = WORKLOADS["anchor" if requests <= 256 else "r1024"]
    warm = dataclasses.replace(WARM, num_requests=args.clients, prompt_range=workload.prompt_range)
    if args.smoke:
        workload, warm = workload.smoke(), dataclasses.replace(warm.smoke(), num_requests=args.clients)
        workload = dataclasses.replace(workload, num_requests=max(requests, workload.num_requests))
    vocab = (SMOKE_SHAPE if args.smoke else LLAMA_1B)["vocab_size"]
    ids = workload.prompts(vocab)[:requests]
    if len(ids) < requests:
        raise SystemExit(f"--requests {requests}: the workload has {len(ids)} prompts")
    return [prompt_text(p) for p in ids], [prompt_text(p) for p in warm.prompts(vocab)], [len(p) for p in ids]


class Clock:
    def __init__(self):
        self.start = time.monotonic()

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {message}", flush=True)

    def left(self, total: float) -> float:
        return total - (time.monotonic() - self.start)


def build_model(args: argparse.Namespace, clock: Clock) -> Path:
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / ("hf_paged_serve_smoke" if args.smoke
                                                                 else "hf_paged_serve_llama1b")
    if is_built(model_dir, args.smoke):
        clock.log(f"checkpoint: {model_dir} (built before)")
        return model_dir
    clock.log(f"checkpoint: building {model_dir}")
    # In a subprocess: this process never holds GPU memory that the servers could use
    cmd = module_command("benchmarks.serving.model", "--out", str(model_dir), *["--smoke"] * args.smoke)
    subprocess.run(cmd, env=child_env(), check=True, stdout=subprocess.DEVNULL,
                   timeout=max(1.0, clock.left(args.total_timeout)))
    clock.log("checkpoint: built")
    return model_dir


async def run_system(system: str, args: argparse.Namespace, model_dir: Path, load: tuple, clock: Clock,
                     log_dir: Path) -> dict:
    """Start, warm up, load and stop one server; its row."""
    extra = shlex.split((SMOKE_ARGS if args.smoke else DEFAULT_ARGS)[system]) + shlex.split(
        getattr(args, f"{system}_args"))
    shown = "hf-paged serve" if system == "hf_paged" else "transformers serve --continuous-batching"
    row = {"system": system, "server_args": f"{shown} {shlex.join(extra)}", "log": f"serve_{system}.log",
           "status": "starting"}
    budget = min(args.system_timeout, clock.left(args.total_timeout) - 20)  # 20 s kept for stopping
    if budget <= 0:
        row["status"] = "skipped: --total-timeout spent"
        return row
    start = time.monotonic()
    clock.log(f"{system}: starting `{row['server_args']}` ({budget:.0f} s budget, log {row['log']})")
    cmd, model = server_command(system, model_dir, free_port(), extra)
    with ServerProcess(cmd, log_dir / row["log"], ROOT, {"OMP_NUM_THREADS": "1"} if args.smoke else {}) as server:
        try:
            await asyncio.wait_for(_measure(system, server, model, args, load, clock, row), budget)
            row["status"] = "ok"
        except asyncio.TimeoutError:
            row["status"] = f"timeout during {row['status']} ({budget:.0f} s budget)"
        except (RuntimeError, httpx.HTTPError) as exc:
            row["status"] = f"failed during {row['status']}: {exc}"
        if row["status"] != "ok":
            row["log_tail"] = server.log_tail()
            print(f"--- the last lines of {row['log']} ---\n{row['log_tail']}\n---", flush=True)
    clock.log(f"{system}: {row['status']}, stopped after {time.monotonic() - start:.1f} s")
    return row


async def _measure(system: str, server: ServerProcess, model: str, args: argparse.Namespace, load: tuple,
                   clock: Clock, row: dict) -> None:
    """Wait for the server, warm it up, run the timed load; ``row["status"]`` says which stage it is in."""
    texts, warm, lengths = load
    start = time.monotonic()
    await server.wait_ready()
    row["startup_s"] = time.monotonic() - start
    clock.log(f"{system}: up in {row['startup_s']:.1f} s; warm-up ({len(warm)} requests)")
    row["status"] = "warm-up"
    timeout = args.system_timeout  # per request; the whole stage is bounded by the caller
    warmed = await drive(server.url, model, warm, args.warmup_tokens, args.clients, timeout)
    if warmed["errors"]:
        raise RuntimeError(f"{warmed['errors']} of {warmed['requests']} warm-up requests failed")
    row["warmup_s"] = warmed["seconds"]
    clock.log(f"{system}: warm in {row['warmup_s']:.1f} s; timed load ({len(texts)} requests, {args.clients} "
              f"clients, {args.max_tokens} tokens each)")
    row["status"] = "load"
    summary = await drive(server.url, model, texts, args.max_tokens, args.clients, timeout, log=clock.log)
    row.update(summary)
    row["exact"] = summary["errors"] == 0 and summary["short"] == 0 and summary["prompt_tokens"] == sum(lengths)


def table(rows: list[dict]) -> str:
    lines = [f"{'system':<13} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
             f"{'requests':>9} {'exact':>6} {'load s':>7}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['system']:<13} {r['status']}")
            continue
        lines.append(f"{r['system']:<13} {r['output_tok_per_s']:>9,.0f} {r['ttft_p50_ms']:>7.0f}ms "
                     f"{r['ttft_p99_ms']:>7.0f}ms {r['tpot_p50_ms']:>7.1f}ms {r['tpot_p99_ms']:>7.1f}ms "
                     f"{r['requests'] - r['errors']:>4}/{r['requests']:<4} {str(r['exact']):>6} {r['seconds']:>7.1f}")
    ok = {r["system"]: r for r in rows if r["status"] == "ok"}
    if {"hf_paged", "transformers"} <= set(ok):
        a, b = ok["hf_paged"], ok["transformers"]
        ratio = a["output_tok_per_s"] / b["output_tok_per_s"]
        met = ratio >= 2 and a["tpot_p99_ms"] <= b["tpot_p99_ms"]
        lines.append(f"hf_paged / transformers: {ratio:.2f}x output tok/s, p99 TPOT {a['tpot_p99_ms']:.1f} vs "
                     f"{b['tpot_p99_ms']:.1f} ms (target >= 2x at equal or better p99 TPOT: "
                     f"{'met' if met else 'not met'})")
    return "\n".join(lines)


def environment(smoke: bool) -> dict:
    """The run's header, read once the servers are done (so this process held no GPU memory while they ran)."""
    from hf_paged.bench import run_header

    return run_header("cpu" if smoke else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a time limit's) unwinds like Ctrl-C, so the running server is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    clock = Clock()
    log_dir = args.log_dir or (args.json.parent if args.json else Path(tempfile.mkdtemp(prefix="serve_compare_")))
    log_dir.mkdir(parents=True, exist_ok=True)
    load = prompts(args)
    clock.log(f"systems: {', '.join(args.systems)}; {len(load[0])} requests ({min(load[2])}-{max(load[2])} prompt "
              f"tokens), {args.clients} clients, {args.max_tokens} new tokens each; logs in {log_dir}")
    model_dir = build_model(args, clock)
    rows = [asyncio.run(run_system(s, args, model_dir, load, clock, log_dir)) for s in args.systems]
    result = {"clients": args.clients, "requests": len(load[0]), "max_tokens": args.max_tokens,
              "prompt_tokens": sum(load[2]), "smoke": args.smoke, "elapsed_s": time.monotonic() - clock.start,
              **environment(args.smoke), "rows": rows}
    print(table(rows))
    clock.log("done")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["status"] == "ok" and r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
