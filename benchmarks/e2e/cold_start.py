"""Cold start: import -> first token and import -> steady state, in a first and a second process, per system.

Systems (``--systems``, in this order by default), each with no settings:
  generate_batch  ``hf_paged.generate_batch(model, prompts, config)``
  generate_batch_eager  the same with the layers left eager (``compile_layers=False`` in the continuous-batching
                  config): what a one-off call gets without torch.compile's first compile
  engine          ``hf_paged.Engine(model)``, then ``engine.stream(prompts, config)``
  generate        ``model.generate`` on a compileable ``PagedAttentionCache`` after ``hf_paged.optimize_generate``,
                  batch 1 (the first prompt)
  serve           ``hf-paged serve --model DIR`` (no engine flags): ready (``/health`` answers), then one streamed
                  completion of the first prompt
  transformers    transformers' own ``model.generate_batch`` (sdpa; it switches to flash-attn where installed): the
                  baseline of generate_batch's first call on the same work

The work: the first ``--prompts`` (default 64) prompts of the end-to-end anchor (128-1024 random tokens, seed 0),
``--new-tokens`` (default 128) each, greedy, no EOS, on the e2e benchmark's Llama-3.2-1B-shaped random bf16 model.

Each system runs in fresh processes one after the other. The first starts with an empty cache folder of its own
(torch's inductor and triton caches and hf_paged's compile artifacts point into it): it compiles and captures
everything. The second finds what the first left: what a user's second run gets. ``--portable`` adds a third
with torch's caches empty again but hf_paged's artifact files kept (a new container with the same home folder).
The CUDA kernels' JIT build keeps its usual cache and is built (timed apart) before anything is timed.

Columns, in seconds from the process's spawn (``python`` starting included): ``import`` (torch, transformers and,
for hf_paged's systems, hf_paged imported; transformers' own runs without hf_paged), ``load`` (model on the
device), ``first_token`` (the first new token on the host: the earliest of the results' token timestamps for the
batch calls, the first streamed token otherwise), ``steady`` (the first call done: everything compiled and captured;
serve: the first response done), ``ready`` (serve); and
``second_call`` (the same call again, its own duration: the steady cost of the work). ``dynamo_s`` and the cache
counters (inductor's FX graph cache and the AOTAutograd cache: hits / misses) show where a process's compile
time went.

    python -m benchmarks.e2e.cold_start
        [--systems generate_batch,generate_batch_eager,engine,generate,serve,transformers]
        [--prompts 64] [--new-tokens 128] [--second SYSTEMS] [--rounds N] [--portable] [--json F] [--model-dir DIR]
        [--timeout 600] [--smoke]

``--rounds N`` runs it all N times, the systems' order reversed every other round (a first process's numbers move
with what ran before it: the host's file cache, the device's clocks), and the table gives each system and process
the medians of its rounds. ``--second S`` (a comma list of systems; default every one) gives only those systems the processes after the
first (``second``, ``portable``, ``second_profiled``); the others run a first process alone. So a smoke check can
run every system once, and a second process only where it does something else.

``--profile-dir D`` adds, per system, one more second process whose first call runs under ``cProfile`` (its stats
file goes to ``D/<system>.prof``, and the functions with the most cumulative time are printed): where the time of a
warm start goes. Its row is labelled ``second_profiled``; profiling slows Python, so it is not a timing.

Bytecode (``--bytecode``): a pip install compiles every package's bytecode once, and each process then loads it.
A Python that writes none (``PYTHONDONTWRITEBYTECODE``, a read-only site folder without ``__pycache__``) compiles
the source of every module each process imports instead: several seconds of import and of the first compile that
a user's installation does not pay. ``auto`` (the default) then compiles the packages the children import (those of
the modules they hold after importing, each package whole) into one cache folder beforehand (``compileall``, timed
apart, as an install does it) and points every child there (``PYTHONPYCACHEPREFIX``), for every system alike;
``compile`` does so always, ``as-is`` never. The result's ``meta.bytecode`` says which. The folder is a new
temporary one unless ``--bytecode-dir DIR`` names one: kept, so that a later run compiles only what changed.

``--smoke`` runs every path on the CPU with a tiny model (4 prompts, 4 new tokens, the tiny serve checkpoint);
its numbers mean nothing. A CPU's own cold start (``hf-paged generate`` against transformers' ``generate`` on
SmolLM2) is ``benchmarks.e2e.cold_start_cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks import ROOT, child_env, comma_names, module_command

SYSTEMS = ("generate_batch", "generate_batch_eager", "engine", "generate", "serve", "transformers")
SERVERS = ("serve",)
COLUMNS = ("import", "load", "first_token", "steady", "ready", "second_call")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    p.add_argument("--prompts", type=int, help="prompts of the work (default 64; smoke 4)")
    p.add_argument("--new-tokens", type=int, help="new tokens per prompt (default 128; smoke 4)")
    p.add_argument("--second", help="comma list of the systems that run the processes after the first (default "
                   "every system)")
    p.add_argument("--rounds", type=int, default=1, help="run every system's processes this many times, the order "
                   "of the systems reversed every other round (the table: medians per system and process)")
    p.add_argument("--portable", action="store_true", help="a third process: torch's caches empty, hf_paged's kept")
    p.add_argument("--json", help="write the rows here (rewritten after each process)")
    p.add_argument("--model-dir", type=Path, help="the serve checkpoint's folder (built there unless it holds it)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one process may take")
    p.add_argument("--profile-dir", type=Path, help="profile one more warm process per system (cProfile) into here")
    p.add_argument("--bytecode", choices=("auto", "compile", "as-is"), default="auto",
                   help="compile the packages' bytecode beforehand: where this Python writes none (auto), always, "
                        "or never (default auto)")
    p.add_argument("--bytecode-dir", type=Path, help="compile the bytecode into this folder, kept for later runs "
                   "(default: a new temporary one)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check every path runs")
    p.add_argument("--cprofile", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=[s for s in SYSTEMS if s not in SERVERS], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = comma_names(args.systems, SYSTEMS, "--systems", p.error)
    args.second = (args.systems if args.second is None
                   else [s.strip() for s in args.second.split(",") if s.strip()])
    outside = sorted(set(args.second) - set(args.systems))
    if outside:
        p.error(f"--second: {outside} not in --systems; name only systems that --systems runs")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.prompts = args.prompts or (4 if args.smoke else 64)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 128)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        child(args)
        return []
    return parent(args)


# ===== the parent: processes, caches, the table ====================================================================

def parent(args: argparse.Namespace) -> list[dict]:
    import torch

    from hf_paged import envs

    clock = time.perf_counter()
    log = lambda message: print(f"[{time.perf_counter() - clock:7.1f} s] {message}", flush=True)  # noqa: E731
    meta = environment(args)
    if torch.cuda.is_available() and not args.smoke:
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hf_paged", "build-kernels"], check=True, cwd=ROOT, env=_env({}))
        meta["kernels_build_s"] = round(time.perf_counter() - began, 2)
        log(f"kernels ready ({meta['kernels_build_s']} s)")
    model_dir = None
    if set(SERVERS) & set(args.systems):
        model_dir = args.model_dir or Path(tempfile.gettempdir()) / ("cold_start_model" + ("_smoke" if args.smoke
                                                                                          else ""))
        subprocess.run(module_command("benchmarks.serving.model", "--out", str(model_dir))
                       + (["--smoke", "--device", "cpu"] if args.smoke else []), check=True, cwd=ROOT, env=_env({}),
                       stdout=subprocess.DEVNULL)
    bytecode_env = {}
    if args.bytecode == "compile" or (args.bytecode == "auto" and writes_no_bytecode()):
        prefix = args.bytecode_dir or Path(tempfile.mkdtemp(prefix="cold_start_bytecode_"))
        began = time.perf_counter()
        folders = package_folders(args.systems)
        compile_bytecode(folders, prefix)
        bytecode_env = {"PYTHONPYCACHEPREFIX": str(prefix)}
        meta["bytecode"] = (f"compiled beforehand into one cache folder for every child ({len(folders)} package "
                            f"folders, {time.perf_counter() - began:.1f} s)")
        log(meta["bytecode"])
    else:
        meta["bytecode"] = "as installed" if not writes_no_bytecode() else "none: each process compiles its sources"
    kernels = str(envs.kernel_cache_dir())
    rows: list[dict] = []
    processes = ("first", "second") + (("portable",) if args.portable else ()) + (
        ("second_profiled",) if args.profile_dir else ())
    for round_, system in round_plan(args.systems, args.rounds):
        root = Path(tempfile.mkdtemp(prefix=f"cold_start_{system}_"))
        for which in processes:
            caches = root / ("portable" if which == "portable" else "torch")
            env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton"),
                   "XDG_CACHE_HOME": str(root / "xdg"), "HF_PAGED_CACHE": kernels, **bytecode_env}
            if which != "first" and system not in args.second:
                continue
            log(f"{system} / {which} process ...")
            profile = None
            if which == "second_profiled":
                if system in SERVERS:
                    continue
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                profile = args.profile_dir / f"{system}.prof"
            try:
                row = (run_server(args, model_dir, env) if system in SERVERS
                       else run_child(system, args, env, profile))
            except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others
                row = {"status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            row = {"system": system, "process": which, **({"round": round_} if args.rounds > 1 else {}), **row}
            rows.append(row)
            log(f"{system} / {which}: " + ", ".join(f"{c} {row[c]:.2f}" for c in COLUMNS if row.get(c) is not None)
                + ("" if row.get("status") == "ok" else f" ({row.get('status')}: {row.get('error')})"))
            if args.json:
                Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    for system in args.systems if args.profile_dir else ():
        if (args.profile_dir / f"{system}.prof").is_file():
            print_profile(system, args.profile_dir / f"{system}.prof")
    return rows


def print_profile(system: str, path: Path, limit: int = 45) -> None:
    """The functions of a profiled warm process's first call with the most cumulative time."""
    import pstats

    print(f"\n== {system}: the warm process's first call, by cumulative time ==")
    pstats.Stats(str(path)).sort_stats("cumulative").print_stats(limit)


def _env(extra: dict) -> dict:
    """This checkout's hf_paged, no network, and ``extra`` (the process's cache folders; with a bytecode folder
    (``PYTHONPYCACHEPREFIX``), the process reads and writes bytecode there)."""
    env = {**child_env(), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}
    if "PYTHONPYCACHEPREFIX" in extra:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def writes_no_bytecode() -> bool:
    """Whether this Python leaves imported modules without bytecode (``-B`` or ``PYTHONDONTWRITEBYTECODE``)."""
    return sys.dont_write_bytecode or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))


# What a child imports, before its first call and in its compile (the serve system's server too); the packages of
# the modules these leave loaded get their bytecode compiled
_CHILD_IMPORTS = ("torch", "transformers", "hf_paged", "torch._inductor.compile_fx", "torch._dynamo")


def package_folders(systems: list[str]) -> list[str]:
    """The folders of the installed packages whose modules a child holds after its imports (this checkout's
    hf_paged included; the standard library left out), found in a process of their own."""
    imports = _CHILD_IMPORTS + (("hf_paged.server",) if set(SERVERS) & set(systems) else ())
    code = ("import importlib, importlib.util, json, sys, sysconfig\n"
            f"for name in {imports!r}: importlib.import_module(name)\n"
            "if importlib.util.find_spec('triton'): import triton\n"
            "std = sysconfig.get_paths()['stdlib']\n"
            "out = set()\n"
            "for top in sorted({n.split('.')[0] for n in list(sys.modules)}):\n"
            "    spec = getattr(sys.modules.get(top), '__spec__', None)\n"
            "    for where in (spec.submodule_search_locations or []) if spec else []:\n"
            "        if not where.startswith(std) or 'packages' in where:\n"
            "            out.add(where)\n"
            "print(json.dumps(sorted(out)))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env({}), capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_bytecode(folders: list[str], prefix: Path) -> None:
    """Compile every module of ``folders`` into the bytecode cache folder ``prefix``, on every core."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *folders], cwd=ROOT,
                   env=_env({"PYTHONPYCACHEPREFIX": str(prefix)}), stdout=subprocess.DEVNULL, check=False)


def run_child(system: str, args: argparse.Namespace, env: dict, profile: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = module_command(__spec__.name, "--child", system, "--result", str(result), "--prompts",
                             str(args.prompts), "--new-tokens", str(args.new_tokens), *["--smoke"] * args.smoke,
                             *(["--cprofile", str(profile)] if profile else []))
        spawned = time.time()
        run = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=args.timeout)
        if run.returncode != 0 or not result.is_file():
            tail = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
            return {"status": "failed", "error": f"exit {run.returncode}: {tail[-400:]}"}
        stamps = json.loads(result.read_text())
    at = {k: None if v is None else round(v - spawned, 3) for k, v in stamps.pop("at").items()}
    return {"status": "ok", **at, **stamps}


def run_server(args: argparse.Namespace, model_dir: Path, env: dict) -> dict:
    from benchmarks.serving.server import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "hf_paged", "serve", "--model", str(model_dir), "--served-model-name", "m",
           "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "5"] + (
        ["--device", "cpu"] if args.smoke else [])
    prompt = first_prompts(args, 128256 if not args.smoke else 2000)[0]
    with tempfile.TemporaryDirectory() as tmp:
        spawned = time.time()
        with ServerProcess(cmd, Path(tmp) / "server.log", ROOT, env=_env(env)) as server:
            try:
                asyncio.run(asyncio.wait_for(server.wait_ready(poll_s=0.05), args.timeout))
            except Exception:
                raise RuntimeError(f"the server did not get ready: {server.log_tail(5)}") from None
            ready = time.time()
            first, done = asyncio.run(completion(server.url, prompt, args.new_tokens))
            again, again_done = asyncio.run(completion(server.url, prompt, args.new_tokens, started=time.time()))
    return {"status": "ok", "ready": round(ready - spawned, 3), "first_token": round(first - spawned, 3),
            "steady": round(done - spawned, 3), "second_call": round(again_done - again[1], 3)}


async def completion(url: str, prompt: list[int], new_tokens: int, started: float | None = None):
    """One streamed greedy completion: (the time of its first token, of its end); with ``started``: ((first,
    started), end)."""
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    first = None
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and '"text"' in line:
                    first = time.time()
    end = time.time()
    return ((first, started), end) if started is not None else (first, end)


def environment(args: argparse.Namespace) -> dict:
    # imported here, in the parent only: this module also runs transformers' baseline child, which must not
    # import hf_paged
    from hf_paged.bench import run_header

    return {**run_header("cpu" if args.smoke else None), "prompts": args.prompts, "new_tokens": args.new_tokens,
            "smoke": args.smoke}


def round_plan(systems: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, system) in the order they run: round r in the order of ``systems`` where r is even, reversed where odd."""
    return [(r, system) for r in range(rounds) for system in (systems[::-1] if r % 2 else systems)]


def medians(rows: list[dict]) -> list[dict]:
    """One row per (system, process): the medians of its rounds' numbers where every round went well, else its
    rounds' rows as they are."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["process"]), []).append(row)
    out = []
    for (system, process), group in groups.items():
        if len(group) == 1 or any(r.get("status") != "ok" for r in group):
            out.extend(group)
            continue
        numbers = {k for r in group for k, v in r.items() if isinstance(v, (int, float)) and k != "round"}
        out.append({"system": system, "process": process, "status": "ok", "rounds": len(group),
                    **{k: statistics.median(r[k] for r in group if k in r) for k in numbers}})
    return out


def table(rows: list[dict]) -> str:
    head = ["system", "process", *COLUMNS, "dynamo_s", "fx hit/miss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in medians(rows):
        cells = [row["system"], row["process"]]
        cells += ["-" if row.get(c) is None else f"{row[c]:.2f}" for c in COLUMNS]
        cells += ["-" if row.get("dynamo_s") is None else f"{row['dynamo_s']:.1f}",
                  "-" if row.get("fxgraph_cache_hit") is None else
                  f"{row['fxgraph_cache_hit']:g}/{row['fxgraph_cache_miss']:g}"]
        if row.get("status") != "ok":
            cells[-1] += f" {row.get('status')}: {row.get('error', '')[:80]}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def first_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    from benchmarks.e2e.workloads import WORKLOADS

    anchor = WORKLOADS["anchor"].smoke() if args.smoke else WORKLOADS["anchor"]
    return anchor.prompts(vocab)[: args.prompts]


# ===== a child: one system in this process ==========================================================================

def child(args: argparse.Namespace) -> None:
    at = {"start": time.time()}
    import torch
    import transformers
    from transformers import GenerationConfig

    ours = args.child != "transformers"
    hf_paged = importlib.import_module("hf_paged") if ours else None  # transformers' baseline runs without it
    at["import"] = time.time()
    from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, load_model

    if args.smoke:
        torch.set_num_threads(1)
    shape, device = (SMOKE_SHAPE, "cpu") if args.smoke else (LLAMA_1B, "cuda")
    model = load_model(shape, device, hf_paged.ATTN_IMPLEMENTATION if ours else "sdpa")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    at["load"] = time.time()
    prompts = first_prompts(args, shape["vocab_size"])
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    eager = SimpleNamespace(compile_layers=False)  # read by name, as transformers' ContinuousBatchingConfig
    # only the system's own call is built: building another's would set up its system on this model
    # (optimize_generate installs its decode linears on every model it is given)
    make = {"generate_batch": lambda: _batch_call(lambda p, c, **kw: hf_paged.generate_batch(model, p, c, **kw)),
            "generate_batch_eager": lambda: _batch_call(lambda p, c, **kw: hf_paged.generate_batch(
                model, p, c, continuous_batching_config=eager, **kw)),
            "transformers": lambda: _batch_call(_transformers_call(model, transformers, args.smoke)),
            "engine": lambda: _engine_call(hf_paged, model),
            "generate": lambda: _generate_call(hf_paged, model, torch, device, args.new_tokens)}
    run = make[args.child]()
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        first = profiler.runcall(run, prompts, config, True)
        sync()
        profiler.dump_stats(args.cprofile)
    else:
        first = run(prompts, config, True)
    sync()
    at["steady"], at["first_token"] = time.time(), first
    second = _timed_call(run, prompts, config, sync)
    # modules holding an hf_paged forward patch (compiled layers, skinny linears): 0 for transformers' own system
    patched = sum(1 for m in model.modules() if "_hf_paged_patches" in m.__dict__)
    Path(args.result).write_text(json.dumps({"at": at, "second_call": round(second, 3), "hf_paged_patches": patched,
                                             "hf_paged_imported": "hf_paged" in sys.modules,
                                             **compile_counters()}))


def _timed_call(run, prompts, config, sync) -> float:
    """Seconds of one more call of the work, its device work included."""
    began = time.perf_counter()
    run(prompts, config, False)
    sync()
    return time.perf_counter() - began


def _batch_call(generate):
    """A batch call (hf_paged's or transformers' generate_batch); the first one records token timestamps and
    returns the wall time of the earliest."""
    def run(prompts, config, first: bool):
        offset = time.time() - time.perf_counter()
        out = generate(prompts, config, record_timestamps=first)
        stamps = [o.timestamps[0] for o in out.values() if getattr(o, "timestamps", None)]
        return offset + min(stamps) if first and stamps else None

    return run


def _transformers_call(model, transformers, smoke: bool):
    def generate(prompts, config, **kwargs):
        # on the CPU transformers would size its cache from the RAM and warm up its whole step budget
        cb = transformers.ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=256) if smoke else None
        return model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                                    progress_bar=False, **kwargs)

    return generate


def _engine_call(hf_paged, model):
    engine = None

    def run(prompts, config, first: bool):
        nonlocal engine
        if engine is None:
            engine = hf_paged.Engine(model)
        if not first:
            engine.generate(prompts, config)
            return None
        seen = None
        for _ in engine.stream(prompts, config):
            seen = seen or time.time()
        return seen

    return run


def _generate_call(hf_paged, model, torch, device: str, new_tokens: int):
    from transformers.generation.streamers import BaseStreamer

    from hf_paged.hf.compat import with_cache

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):  # the prompt first, then each new token
            self.calls += 1
            if self.calls == 2:
                self.at = time.time()

        def end(self):
            pass

    hf_paged.optimize_generate(model)
    cache = None

    def run(prompts, config, first: bool):
        nonlocal cache
        ids = torch.tensor([prompts[0]], device=device)
        if cache is None:
            cache = hf_paged.PagedAttentionCache(model.config, num_blocks=-(-(ids.shape[1] + new_tokens) // 16) + 8,
                                                 device=device, dtype=model.dtype, max_new_tokens=new_tokens)
        streamer = FirstToken() if first else None
        # as keywords, as benchmarks/generate/latency.py passes them: the model's generation config keeps the compile
        # config optimize_generate set
        model.generate(**with_cache(model, cache, input_ids=ids, attention_mask=torch.ones_like(ids)),
                       max_new_tokens=config.max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                       streamer=streamer)
        return streamer.at if streamer is not None else None

    return run


def compile_counters() -> dict:
    """Where this process's compile time went: dynamo's own seconds, inductor's FX graph cache and the AOTAutograd
    cache (hits, misses)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return {}
    return {"dynamo_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 2),
            **{k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
            **{k: counters["aot_autograd"][k] for k in ("autograd_cache_hit", "autograd_cache_miss")}}


if __name__ == "__main__":
    main()
