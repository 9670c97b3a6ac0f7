"""The same benchmarks on two checkouts, alternated in one run on one card: does a change keep the speed?

Each round runs every part once in each checkout, in turn (the ``--first`` one first), each in a process of its own
started in that checkout's folder; a part's figure per checkout is its median over the rounds. The baseline
(transformers' own continuous batching, ``--baseline``) runs once, on the anchor workload, in the first checkout
that runs the anchor part.

Parts (``--parts``):
  anchor    ``benchmarks.e2e.throughput --workloads anchor,latency --systems hf_paged``: the anchor workload's
            output tok/s (256 prompts of 128-1024 random tokens, 256 new, greedy, Llama-3.2-1B-shaped bf16,
            8192-token budget) and batch-1 decode ms per output token (the per-token timestamps' mean spacing, as that
            script's table)
  latency   the anchor part's batch-1 decode alone (``--workloads latency``): a process that compiles the layers
            for batch 1 only
  defaults  ``benchmarks.e2e.throughput --workloads anchor,r64,latency --systems hf_paged --defaults --calls 3``:
            with no settings, the anchor and its first 64 prompts (the process's first call and the median of the
            two later calls) and batch-1 decode ms per output token
  generate  ``benchmarks.generate.latency --systems hf_paged_optimized --batches 1,64``: plain ``model.generate``
            with ``optimize_generate``, ms per decode step at batch 1 and 64, and ms per token of the whole call
            (prefill included)
  start     ``benchmarks.engine.start --variants auto --rounds 1``: a kept engine's start (``Engine(model)``, no
            settings) in a process that finds the compile artifacts of the one before it, and its batch-1 decode

A part named with a checkout (``start@new``) runs in that checkout alone, its figures unpaired (``-`` in the
other column): a cheaper run, or a smoke check of every part's plumbing that runs each part once.

    python -m benchmarks.e2e.ab_checkouts --old ../old --new . --rounds 2 --json ab.json
    python -m benchmarks.e2e.ab_checkouts --table ab.json

The JSON holds every figure of every round, the medians, the card and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = ("anchor", "latency", "defaults", "generate", "start")


SMOKE: list[str] = []  # ["--smoke"] with --smoke: every script on its tiny CPU model


# module -> its script in a checkout from before the benchmarks became a package
_FLAT_SCRIPTS = {"benchmarks.e2e.throughput": "benchmarks/e2e_throughput.py",
                 "benchmarks.generate.latency": "benchmarks/generate_latency.py",
                 "benchmarks.engine.start": "benchmarks/engine_start.py"}


def _run(folder: Path, argv: list[str], timeout: float) -> tuple[list[dict], float, str]:
    """Rows of the JSON that the benchmark module ``argv[0]`` of ``folder`` writes (run by path in a checkout
    whose benchmarks are flat scripts), its wall time and its output's tail."""
    module, *rest = argv
    packaged = (folder / "benchmarks" / "__init__.py").is_file()
    argv = ["-m", module, *rest] if packaged else [_FLAT_SCRIPTS[module], *rest]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        began = time.perf_counter()
        done = subprocess.run([sys.executable, *argv, *SMOKE, "--json", str(out)], cwd=folder, env=env, text=True,
                              capture_output=True, timeout=timeout)
        seconds = time.perf_counter() - began
        tail = (done.stdout + done.stderr)[-1500:]
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(argv)} in {folder} exited {done.returncode}:\n{tail}")
        data = json.loads(out.read_text())
        return (data["rows"] if isinstance(data, dict) and "rows" in data else data), seconds, tail


def _anchor(folder: Path, systems: str, timeout: float, workloads: str = "anchor,latency") -> dict:
    rows, seconds, _ = _run(folder, ["benchmarks.e2e.throughput", "--workloads", workloads,
                                     "--systems", systems], timeout)
    figures = {}
    for row in rows:
        if row.get("status") != "ok":
            raise RuntimeError(f"{row['system']} {row['workload']}: {row.get('status')} {row.get('error', '')}")
        key = f"{row['system']} {row['workload']}"
        # latency: the per-token timestamps' mean spacing where the row has them, as e2e_throughput's own table
        # reads it (the difference of two calls' medians can come out below zero on a short, noisy run)
        figures[key] = ((row.get("ms_per_token_timestamps") or row["ms_per_token"]) if row["workload"] == "latency"
                        else row["tok_per_s"])
    return _measured(figures, seconds, rows[0])


def _measured(figures: dict, seconds: float, row: dict) -> dict:
    """A part's figures with its wall time and the card and versions an e2e row records."""
    return {"figures": figures, "seconds": seconds, "card": row.get("card"), "versions": {
        k: row.get(k) for k in ("torch", "transformers", "flash_attn", "date") if k in row}}


def _defaults(folder: Path, timeout: float) -> dict:
    rows, seconds, _ = _run(folder, ["benchmarks.e2e.throughput", "--workloads", "anchor,r64,latency",
                                     "--systems", "hf_paged", "--defaults", "--calls", "3"], timeout)
    figures = {}
    for row in rows:
        name = f"{row['workload']}, no settings"
        if row.get("status") != "ok":
            raise RuntimeError(f"hf_paged {name}: {row.get('status')} {row.get('error', '')}")
        if row["workload"] == "latency":
            figures[f"{name}, ms/token"] = row.get("ms_per_token_timestamps") or row["ms_per_token"]
            continue
        figures[f"{name}, first call tok/s"] = row["tok_per_s"]
        if row.get("later_tok_per_s"):
            figures[f"{name}, later calls tok/s"] = row["later_tok_per_s"]
    return _measured(figures, seconds, rows[0])


GENERATE_NEW_TOKENS = 128


def _generate(folder: Path, timeout: float) -> dict:
    rows, seconds, _ = _run(folder, ["benchmarks.generate.latency", "--systems", "hf_paged_optimized",
                                     "--batches", "1,64", "--new-tokens", str(GENERATE_NEW_TOKENS)], timeout)
    figures = {}
    for row in rows:
        if row.get("status") != "ok":
            raise RuntimeError(f"generate batch {row.get('batch')}: {row.get('status')} {row.get('error', '')}")
        figures[f"generate optimized B{row['batch']} ms/step"] = row["ms_per_step"]
        # the whole call (prefill, setup and every step) over its new tokens: what a caller waits per token
        figures[f"generate optimized B{row['batch']} ms/token all-in"] = row["warm_call_s"] / GENERATE_NEW_TOKENS * 1e3
    return _measured(figures, seconds, rows[0])


def _start(folder: Path, timeout: float) -> dict:
    rows, seconds, _ = _run(folder, ["benchmarks.engine.start", "--variants", "auto", "--rounds", "1"], timeout)
    later = [r for r in rows if r.get("process") == "second"]
    if not later or later[0].get("status") != "ok":
        raise RuntimeError(f"engine start: {later[0].get('error', '') if later else 'no later process'}")
    return _measured({"engine start s, a later process": later[0]["engine_s"],
                      "engine start, batch 1 ms/token": later[0]["b1_ms"]}, seconds, later[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, help="the checkout before the change")
    parser.add_argument("--new", type=Path, help="the checkout with the change")
    parser.add_argument("--parts", default="anchor,generate", help="comma list of " + ", ".join(PARTS)
                        + "; PART@old or PART@new runs it in that checkout alone")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--first", choices=("old", "new"), default="new")
    parser.add_argument("--baseline", action="store_true", help="transformers' continuous batching on the anchor too")
    parser.add_argument("--timeout", type=float, default=400, help="seconds one benchmark process may take")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--table", type=Path, help="print the table of an earlier run's JSON and exit")
    parser.add_argument("--smoke", action="store_true", help="each script's tiny CPU run (checks the plumbing)")
    args = parser.parse_args(argv)
    if args.smoke:
        SMOKE.append("--smoke")
    if args.table:
        print_table(json.loads(args.table.read_text()))
        return 0
    try:
        plan = parse_parts(args.parts)
    except ValueError as exc:
        parser.error(str(exc))
    order = ["new", "old"] if args.first == "new" else ["old", "new"]
    folders = {"old": args.old.resolve(), "new": args.new.resolve()}
    result = {"parts": [part if only is None else f"{part}@{only}" for part, only in plan], "rounds": [],
              "baseline": None}
    for r in range(args.rounds):
        for tag in order:
            for part in (part for part, only in plan if only in (None, tag)):
                if part == "anchor":
                    first = not any(run["part"] == "anchor" for run in result["rounds"])
                    systems = "hf_paged,transformers" if args.baseline and first else "hf_paged"
                    got = _anchor(folders[tag], systems, args.timeout)
                elif part == "latency":
                    got = _anchor(folders[tag], "hf_paged", args.timeout, workloads="latency")
                elif part == "defaults":
                    got = _defaults(folders[tag], args.timeout)
                elif part == "start":
                    got = _start(folders[tag], args.timeout)
                else:
                    got = _generate(folders[tag], args.timeout)
                result["rounds"].append({"round": r, "checkout": tag, "part": part, **got})
                print(f"[round {r} {tag} {part}] {got['figures']} ({got['seconds']:.0f} s)", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def parse_parts(text: str) -> list[tuple[str, str | None]]:
    """``latency,start@new`` -> ``[("latency", None), ("start", "new")]`` (None: both checkouts)."""
    plan = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        part, at, only = item.partition("@")
        if part not in PARTS or (at and only not in ("old", "new")):
            raise ValueError(f"--parts: {item!r}: name one of {', '.join(PARTS)}, optionally followed by @old or @new")
        plan.append((part, only or None))
    if not plan:
        raise ValueError("--parts: name at least one part")
    return plan


def medians(result: dict) -> dict[str, dict[str, float]]:
    """``{figure: {checkout: median over rounds}}``."""
    seen: dict[str, dict[str, list[float]]] = {}
    for run in result["rounds"]:
        for name, value in run["figures"].items():
            seen.setdefault(name, {}).setdefault(run["checkout"], []).append(value)
    return {name: {tag: statistics.median(v) for tag, v in by.items()} for name, by in seen.items()}


def print_table(result: dict) -> None:
    card = next((run.get("card") for run in result["rounds"] if run.get("card")), "?")
    print(f"card: {card}; rounds: {1 + max((run['round'] for run in result['rounds']), default=0)}")
    print(f"{'figure':<40} {'old':>12} {'new':>12} {'new/old':>8}")
    for name, by in medians(result).items():
        old, new = by.get("old"), by.get("new")
        ratio = "" if old is None or new is None else f"{new / old:.3f}"
        fmt = lambda v: "-" if v is None else f"{v:,.2f}" if v < 100 else f"{v:,.0f}"  # noqa: E731
        print(f"{name:<40} {fmt(old):>12} {fmt(new):>12} {ratio:>8}")


if __name__ == "__main__":
    raise SystemExit(main())
