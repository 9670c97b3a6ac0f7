"""A kept engine's start in a fresh process (what ``hf-paged serve`` pays after its import and load), and its batch-1
decode, by decode-graph sizes.

Variants (``--variants``, each a name): ``auto`` is ``hf_paged.Engine(model)`` with no settings; any other is a
comma list of graph batch sizes passed as ``cuda_graphs`` (``1,2,4`` ...), or ``auto-1`` / ``auto+1``: the
automatic sizes for 256 sequences without or with a graph of one row. Each variant has a cache folder of its own
(torch's inductor and triton caches, hf_paged's compile artifacts): its first process compiles and is reported as
``first``; then ``--rounds`` rounds run one process per variant, alternating, each finding what its first left
(``second``: a user's later start; ``--rounds 0`` runs the first processes alone). The CUDA kernels' JIT build
keeps its usual cache. Where this Python writes no bytecode, the children's packages get theirs compiled beforehand
into one folder, as ``benchmarks/e2e/cold_start.py`` does (its ``--bytecode auto``; the result's ``meta.bytecode``
says which): a new temporary one, or ``--bytecode-dir DIR``, kept, so that a later run compiles only what changed.

A process: ``import`` (torch, hf_paged), ``load`` (the e2e benchmark's Llama-3.2-1B-shaped random bf16 model on the
device), ``engine_s`` (``Engine(...)``: pool, compile of the layers, decode graphs captured at start), the dynamo
frames traced by then and after the calls below, the captured sizes, and ``b1_ms``: one 300-token prompt, the
fastest of three 256-token calls less the fastest of three 2-token calls, over 254 tokens (after one of each).

    python -m benchmarks.engine.start [--variants auto-1,auto+1] [--rounds 3] [--json F] [--smoke]

``--smoke`` runs every path on the CPU with a tiny model (no graphs, no compile there); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import ROOT, module_command
from benchmarks.e2e.cold_start import _env, compile_bytecode, package_folders, writes_no_bytecode

COLUMNS = ("import", "load", "engine_s", "b1_ms", "frames_at_start", "frames_after")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="auto-1,auto+1", help="names: auto, auto-1, auto+1 or a comma list of "
                   "sizes; several separated by ';'")
    p.add_argument("--rounds", type=int, default=3,
                   help="later processes per variant, alternating (default 3; 0: none)")
    p.add_argument("--json", help="write the rows here (rewritten after each process)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one process may take")
    p.add_argument("--bytecode-dir", type=Path, help="where this Python writes no bytecode: compile it into this "
                   "folder, kept for later runs (default: a new temporary one)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check every path runs")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 0:
        p.error(f"--rounds {args.rounds}: give 0 (first processes only) or more")
    return args


def split_variants(text: str) -> list[str]:
    """``auto-1,auto+1`` -> two names; ``1,2,4;auto`` -> a size list and a name."""
    if ";" in text:
        return [v.strip() for v in text.split(";") if v.strip()]
    parts = [v.strip() for v in text.split(",") if v.strip()]
    return [",".join(parts)] if all(p.isdigit() for p in parts) else parts


def graph_sizes(variant: str) -> list[int] | None:
    """The ``cuda_graphs`` list of a variant; None for ``auto`` (the engine's own)."""
    from hf_paged.runner._graph_sizes import graph_batch_sizes

    if variant == "auto":
        return None
    if variant in ("auto-1", "auto+1"):
        sizes = [s for s in graph_batch_sizes(256) if s != 1]
        return sizes if variant == "auto-1" else sorted({1, *sizes})
    return sorted({int(s) for s in variant.split(",")})


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return []
    return parent(args)


def parent(args: argparse.Namespace) -> list[dict]:
    import torch

    from hf_paged import envs
    from hf_paged.bench import run_header

    variants = split_variants(args.variants)
    meta = {**run_header("cpu" if args.smoke else None), "smoke": args.smoke}
    if torch.cuda.is_available() and not args.smoke:
        subprocess.run([sys.executable, "-m", "hf_paged", "build-kernels"], check=True, cwd=ROOT, env=_env({}))
    bytecode = {}
    meta["bytecode"] = "as installed"
    if writes_no_bytecode():
        prefix = args.bytecode_dir or Path(tempfile.mkdtemp(prefix="engine_start_bytecode_"))
        compile_bytecode(package_folders(["generate_batch"]), prefix)
        bytecode = {"PYTHONPYCACHEPREFIX": str(prefix)}
        meta["bytecode"] = "compiled beforehand into one cache folder for every child"
    kernels = str(envs.kernel_cache_dir())
    roots = {v: Path(tempfile.mkdtemp(prefix="engine_start_")) for v in variants}
    rows: list[dict] = []
    order = [(v, "first") for v in variants] + [(v, "second") for _ in range(args.rounds) for v in variants]
    for variant, which in order:
        root = roots[variant]
        env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
               "XDG_CACHE_HOME": str(root / "xdg"), "HF_PAGED_CACHE": kernels, **bytecode}
        row = {"variant": variant, "process": which, **run_child(variant, args, env),
               **{k: meta[k] for k in ("card", "torch", "transformers", "date")}}
        rows.append(row)
        print(f"{variant} / {which}: " + ", ".join(f"{c} {row[c]}" for c in COLUMNS if c in row)
              + f" sizes {row.get('sizes')}" + ("" if row.get("status") == "ok" else f" ({row.get('error')})"),
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    return rows


def run_child(variant: str, args: argparse.Namespace, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = module_command(__spec__.name, "--child", variant, "--result", str(result), *["--smoke"] * args.smoke)
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"over {args.timeout:.0f} s"}
        if run.returncode != 0 or not result.is_file():
            tail = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
            return {"status": "failed", "error": f"exit {run.returncode}: {tail[-400:]}"}
        return {"status": "ok", **json.loads(result.read_text())}


def table(rows: list[dict]) -> str:
    """Per variant and process kind: the median of each column."""
    import statistics

    lines = ["| variant | process | n | " + " | ".join(COLUMNS) + " |", "|---|---|---|" + "---|" * len(COLUMNS)]
    for key in dict.fromkeys((r["variant"], r["process"]) for r in rows):
        ok = [r for r in rows if (r["variant"], r["process"]) == key and r.get("status") == "ok"]
        cells = [f"{statistics.median(r[c] for r in ok):.3f}" if ok and all(r.get(c) is not None for r in ok)
                 else "-" for c in COLUMNS]
        lines.append(f"| {key[0]} | {key[1]} | {len(ok)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def child(args: argparse.Namespace) -> None:
    began = time.time()
    import torch

    import hf_paged

    imported = time.time() - began
    from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, load_model
    from torch._dynamo.utils import counters
    from transformers import GenerationConfig

    shape, device = (SMOKE_SHAPE, "cpu") if args.smoke else (LLAMA_1B, "cuda")
    model = load_model(shape, device, hf_paged.ATTN_IMPLEMENTATION)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    loaded = time.time() - began
    sizes = graph_sizes(args.child)
    started = time.perf_counter()
    engine = hf_paged.Engine(model) if sizes is None else hf_paged.Engine(model, cuda_graphs=sizes)
    sync()
    engine_s = time.perf_counter() - started
    frames_at_start = counters["frames"]["total"]
    prompt = [list(range(100, 100 + (30 if args.smoke else 300)))]
    long_tokens = 8 if args.smoke else 256

    def call(new_tokens: int) -> float:
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        sync()
        t = time.perf_counter()
        engine.generate(prompt, config)
        sync()
        return time.perf_counter() - t

    call(long_tokens), call(2)
    longs, shorts = [call(long_tokens) for _ in range(3)], [call(2) for _ in range(3)]
    graphs = engine.stats()["cuda_graphs"]
    Path(args.result).write_text(json.dumps({
        "import": round(imported, 3), "load": round(loaded, 3), "engine_s": round(engine_s, 3),
        "b1_ms": round((min(longs) - min(shorts)) / (long_tokens - 2) * 1e3, 4),
        "frames_at_start": frames_at_start, "frames_after": counters["frames"]["total"],
        "sizes": graphs["batch_sizes"] if graphs else None}))
    engine.close()


if __name__ == "__main__":
    main()
