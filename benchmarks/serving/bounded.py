"""Issue 59's bounds on the CPU: no request exhausts memory or holds the others up, no signal hangs or drops anything.

Five parts (``--parts``, comma-separated; default all), each a pass flag against the issue's "Done when" and the
figures behind it:

- ``server``: ``hf-paged serve --model tiny`` with its default flags, a subprocess (the tiny model's position limit,
  2,048 tokens, holds 2,000-token prompts). Its idle RSS, then three requests one after another, each of two prompts
  of 2,000 random token ids at temperature 1: ``n=64, max_tokens=1`` (the issue's 18 KB body); ``n=128`` with
  ``echo`` and ``logprobs=1``; the same with ``logprobs=5``. For each: the status and error, the answer's bytes and
  seconds, its RSS before (what the earlier requests left) and peak RSS above idle (``VmRSS`` read every 10 ms), and
  ``/health`` latency meanwhile (polled every 50 ms). Passes when every peak stays under 1 GB above idle and every
  request is answered: a 200, or a 400 that names the server flag that refuses it (a default limit refusing it by
  design).
- ``workspace``: one engine step of 16 sequences at 1,500 tokens of context plus one 1,500-token prompt on the torch
  backend (the tiny model, 8 query heads, 2 KV heads, head_dim 16), and the same step's attention again with the
  heads of a Llama-3.2-1B-shaped layer (32, 8, 64) on random queries and caches. Each layer's attention is measured
  by counting the bytes of every tensor the aten operators it runs allocate and that are still alive (a
  ``TorchDispatchMode`` holding weak references to their storages; temporaries inside one kernel are not seen),
  beyond its output; next to it the module's bound (``attention/backends/_torch.py``'s ``workspace_bytes``), and what
  one piece padded to the step's longest query and context would take (the padding the issue found). Passes when
  the measured peak is under 300 MB for both shapes and within the bound.
- ``grammar``: on the same server, one ``json_schema`` request with ``n=128`` (64 new tokens each) while 2-token
  requests are sent one after another until it ends; passes when every 2-token request answers within 1 s. A
  one-token request with a tiny schema goes first, untimed: the server's first schema imports the grammar library
  (about half a second on a CPU, more on a loaded one), a cost of the process's first such request, not of the
  large one.
- ``signals``: ``benchmarks/engine/signal_probe.py``'s three probes (100 runs of SIGTERM with ``abort_all()``, of
  SIGUSR1 with ``stats()``, of the hand-over probe); passes when every run returns and no output is lost or doubled.
- ``threads``: two threads, 50 calls each, of ``generate_batch`` on one model (greedy, a kept engine on three calls of
  four); passes when every result equals the single-thread one and no call fails.

Every run sets one torch thread; the whole takes a few minutes of CPU. ``--smoke`` shrinks every part (shorter
prompts, fewer copies and runs) to a quick check that every part runs and reports. The result (``--json F``) starts
with the run's header (``hf_paged.bench.run_header``: versions, commit, date) and the machine's core count.

    python -m benchmarks.serving.bounded [--parts server,workspace,grammar,signals,threads] [--json F] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GenerationConfig

import hf_paged
from benchmarks import ROOT
from benchmarks.engine import signal_probe
from benchmarks.serving.server import ServerProcess, free_port
from hf_paged.attention.backends import _torch as torch_backend
from hf_paged.bench import run_header
from hf_paged.cli.default_model import TINY_NAME, tiny_llama

PARTS = ("server", "workspace", "grammar", "signals", "threads")
RSS_LIMIT = 10**9  # the most a request may add to the server's idle RSS (1 GB)
WORKSPACE_LIMIT = 300 * 10**6  # the most one layer's attention of the step may take
LATENCY_LIMIT_S = 1.0  # the longest a 2-token request may wait while the json_schema request runs
FULL = {"prompt_tokens": 2000, "copies": (64, 128), "context": 1500, "decoding": 16, "grammar_n": 128,
        "grammar_tokens": 64, "signal_runs": 100, "thread_calls": 50}
SMOKE = {"prompt_tokens": 200, "copies": (4, 8), "context": 150, "decoding": 4, "grammar_n": 32, "grammar_tokens": 32,
         "signal_runs": 3, "thread_calls": 3}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
LLAMA_1B_HEADS = (32, 8, 64)  # query heads, KV heads, head_dim


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


# -- server and grammar ------------------------------------------------------------------------------------------


@contextmanager
def tiny_server():
    """A running ``hf-paged serve --model tiny`` with the default flags, and its idle RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "hf_paged", "serve", "--model", "tiny", "--port", str(free_port())]
        server = ServerProcess(cmd, Path(tmp) / "server.log", ROOT, env={"OMP_NUM_THREADS": "1"})
        with server:
            try:
                asyncio.run(server.wait_ready())
            except RuntimeError:
                raise RuntimeError(f"the server did not start:\n{server.log_tail()}") from None
            time.sleep(1.0)  # settled
            yield server, rss(server.proc.pid)


async def _watch(server: ServerProcess, client, peak: list[int], health: list[float], stop: asyncio.Event):
    """Until ``stop``: the server's RSS every 10 ms into ``peak[0]``, ``/health``'s latency every 50 ms."""
    async def rss_loop():
        while not stop.is_set():
            peak[0] = max(peak[0], rss(server.proc.pid))
            await asyncio.sleep(0.01)

    async def health_loop():
        while not stop.is_set():
            t = time.perf_counter()
            await client.get(f"{server.url}/health")
            health.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)

    await asyncio.gather(rss_loop(), health_loop())


async def _request(server: ServerProcess, body: dict, idle: int) -> dict:
    import httpx

    before = rss(server.proc.pid)
    peak, health, stop = [before], [], asyncio.Event()
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client, \
            httpx.AsyncClient(timeout=600, trust_env=False) as watcher:
        watch = asyncio.create_task(_watch(server, watcher, peak, health, stop))
        t = time.perf_counter()
        response = await client.post(f"{server.url}/v1/completions", json=body)
        seconds = time.perf_counter() - t
        stop.set()
        await watch
    error = response.json()["error"]["message"] if response.status_code != 200 else None
    return {"status": response.status_code, "error": error, "response_bytes": len(response.content),
            "seconds": round(seconds, 3), "rss_before_bytes": before, "peak_rss_above_idle_bytes": peak[0] - idle,
            "health_max_s": round(max(health, default=0), 4),
            "health_median_s": round(statistics.median(health), 4) if health else None, "health_polls": len(health)}


def part_server(server: ServerProcess, idle: int, sizes: dict) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(sizes["prompt_tokens"])] for _ in range(2)]
    few, many = sizes["copies"]
    base = {"model": TINY_NAME, "prompt": prompts, "max_tokens": 1, "temperature": 1.0}
    cases = {f"n={few}": {**base, "n": few}, f"n={many} echo logprobs=1": {**base, "n": many, "echo": True,
                                                                          "logprobs": 1},
             f"n={many} echo logprobs=5": {**base, "n": many, "echo": True, "logprobs": 5}}
    requests = {}
    for name, body in cases.items():
        result = asyncio.run(_request(server, body, idle))
        # an answer: a 200, or a 400 naming the flag whose default limit refuses it
        result["answered"] = result["status"] == 200 or (result["status"] == 400 and "(--" in result["error"])
        result["body_bytes"] = len(json.dumps(body))
        requests[name] = result
    ok = all(r["answered"] and r["peak_rss_above_idle_bytes"] < RSS_LIMIT for r in requests.values())
    return {"idle_rss_bytes": idle, "prompt_tokens": sizes["prompt_tokens"], "requests": requests,
            "limit_bytes": RSS_LIMIT, "pass": ok}


async def _grammar(server: ServerProcess, sizes: dict) -> dict:
    import httpx

    big = {"model": TINY_NAME, "prompt": "A person as JSON: ", "n": sizes["grammar_n"],
           "max_tokens": sizes["grammar_tokens"], "temperature": 1.0, "ignore_eos": True,
           "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    small = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    latencies, statuses = [], set()
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        flag = {"type": "json_schema", "json_schema": {"name": "flag", "schema": {"type": "boolean"}}}
        warm = {**small, "max_tokens": 1, "response_format": flag}
        if (response := await client.post(f"{server.url}/v1/completions", json=warm)).status_code != 200:
            statuses.add(response.status_code)  # (fails the part)
        t0 = time.perf_counter()
        task = asyncio.create_task(client.post(f"{server.url}/v1/completions", json=big))
        await asyncio.sleep(0.05)
        while not task.done():
            t = time.perf_counter()
            response = await client.post(f"{server.url}/v1/completions", json=small)
            latencies.append(time.perf_counter() - t)
            statuses.add(response.status_code)
        response = await task
        big_seconds = time.perf_counter() - t0
    choices = response.json().get("choices", []) if response.status_code == 200 else []
    valid = sum(_is_json_object(c["text"]) for c in choices)
    return {"grammar_request": {"n": sizes["grammar_n"], "max_tokens": sizes["grammar_tokens"],
                                "status": response.status_code, "seconds": round(big_seconds, 3),
                                "choices": len(choices), "choices_parsing_as_json": valid},
            "small_requests": len(latencies), "small_statuses": sorted(statuses),
            "small_latency_max_s": round(max(latencies, default=float("inf")), 4),
            "small_latency_median_s": round(statistics.median(latencies), 4) if latencies else None,
            "limit_s": LATENCY_LIMIT_S,
            "pass": bool(latencies) and statuses == {200} and response.status_code == 200
            and max(latencies) < LATENCY_LIMIT_S}


def _is_json_object(text: str) -> bool:
    """Whether ``text`` is a JSON object or the start of one (64 tokens may end a string midway)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return text.lstrip().startswith("{")


def part_grammar(server: ServerProcess, sizes: dict) -> dict:
    return asyncio.run(_grammar(server, sizes))


# -- workspace ----------------------------------------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the aten operators run under it allocate while they stay alive, and their
    peak (a storage is followed through a weak reference; an output on an input's storage, a view or an in-place
    result, adds nothing)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {key: (ref, n) for key, (ref, n) in self.live.items() if not ref.expired()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and key not in inputs and storage.nbytes():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


#: The torch backend's attention, as imported (``part_workspace`` wraps the module's name for one step).
REFERENCE = torch_backend.paged_attention_reference


def measured_attention(*args, **kwargs) -> tuple[torch.Tensor, int]:
    """``paged_attention_reference(*args, **kwargs)`` and the peak bytes it held beyond its output."""
    with LiveBytes() as counter:
        out = REFERENCE(*args, **kwargs)
    return out, counter.peak - out.untyped_storage().nbytes()


def part_workspace(sizes: dict) -> dict:
    context, decoding = sizes["context"], sizes["decoding"]
    torch.manual_seed(0)
    rng = random.Random(0)
    engine = hf_paged.Engine(tiny_llama(), num_blocks=-(-(decoding + 1) * (context + 80) // 16), block_size=16,
                             max_num_seqs=decoding + 1, max_batch_tokens=2048)
    decode = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=None)

    def prompt(n):
        return [rng.randrange(3, 259) for _ in range(n)]

    calls, measure = [], [False]

    def wrapped(query, k_cache, v_cache, meta, params, *args, **kwargs):
        plan = kwargs.get("plan") or torch_backend.StepPlan.of(meta)
        if not measure[0]:
            calls.append({"plan": plan})
            return REFERENCE(query, k_cache, v_cache, meta, params, *args, **kwargs)
        out, peak = measured_attention(query, k_cache, v_cache, meta, params, *args, **kwargs)
        calls.append({"peak": peak, "plan": plan, "meta": meta, "k_cache": k_cache})
        return out

    engine.add_requests([prompt(context - 1) for _ in range(decoding)], decode)
    torch_backend.paged_attention_reference = wrapped
    try:
        while not calls or calls[-1]["plan"].q_lens != [1] * decoding:  # until every sequence decodes
            calls.clear()
            engine.step()
        engine.add_request(prompt(context), GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None))
        calls.clear()
        measure[0] = True
        engine.step()
    finally:
        torch_backend.paged_attention_reference = REFERENCE
    plan, meta = calls[0]["plan"], calls[0]["meta"]
    prompt_rows = sum(q > 1 for q in plan.q_lens)
    step = {"sequences": len(plan.q_lens), "decode_rows": sum(q == 1 for q in plan.q_lens),
            "prompt_tokens": max(plan.q_lens), "context_min": min(plan.k_lens), "context_max": max(plan.k_lens)}
    text = engine.model.config
    shapes = {"tiny": (text.num_attention_heads, text.num_key_value_heads,
                       text.hidden_size // text.num_attention_heads)}
    shapes["llama_1b_heads"] = LLAMA_1B_HEADS
    results = {"step": step, "limit_bytes": WORKSPACE_LIMIT, "pieces_per_layer": len(plan.cut(
        torch_backend.WORKSPACE_BYTES["cpu"], _shape(shapes["tiny"], 16), torch.device("cpu")))}
    for name, heads in shapes.items():
        if name == "tiny":
            peak = max(c["peak"] for c in calls)
        else:  # the same step's attention with bigger heads, on random queries and caches
            h, hkv, d = heads
            num_blocks = calls[0]["k_cache"].shape[0]
            query = torch.randn(sum(plan.q_lens), h, d)
            caches = [torch.randn(num_blocks, 16, hkv, d) for _ in range(2)]
            params = torch_backend.AttentionParams(scale=d ** -0.5)
            peak = measured_attention(query, *caches, meta, params)[1]
        shape = _shape(heads, 16)
        results[name] = {
            "heads": dict(zip(("query", "kv", "head_dim"), heads)), "measured_peak_bytes": peak,
            "bound_bytes": torch_backend.workspace_bytes("cpu", max(plan.k_lens), *shape[:4]),
            "padded_one_piece_bytes": torch_backend.piece_bytes(len(plan.q_lens), max(plan.q_lens),
                                                                max(plan.k_lens), *shape)}
        results[name]["pass"] = peak < WORKSPACE_LIMIT and peak <= results[name]["bound_bytes"]
    results["pass"] = prompt_rows == 1 and all(results[name]["pass"] for name in shapes)
    return results


def _shape(heads: tuple[int, int, int], block_size: int) -> tuple:
    """``piece_bytes``' arguments after the lengths, for float32 queries and cache."""
    return (*heads, block_size, 4, 4)


# -- signals and threads ------------------------------------------------------------------------------------------


def part_signals(sizes: dict) -> dict:
    runs = sizes["signal_runs"]
    results = signal_probe.run_probes(runs=runs, handover_runs=runs, seed=0, hang_after=60.0)
    for result in results.values():
        result["failures"] = result["failures"][:5]
        result["pass"] = not result["failures"] and result.get("returned", result["runs"]) == result["runs"]
    handover = results["hand-over"]
    handover["pass"] = handover["pass"] and handover["lost"] == handover["delivered twice"] == 0
    return {**results, "pass": all(r["pass"] for r in results.values())}


def part_threads(sizes: dict) -> dict:
    calls = sizes["thread_calls"]
    model = tiny_llama()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    rng = random.Random(1)
    work = [[[rng.randrange(3, 259) for _ in range(rng.randint(3, 12))] for _ in range(3)] for _ in range(2)]

    def tokens(prompts, keep):
        results = hf_paged.generate_batch(model, prompts, config, persistent_manager=keep)
        return [r.generated_tokens for r in results.values()]

    expected = [tokens(prompts, False) for prompts in work]  # one thread: the oracle
    got, errors = [[], []], []

    def caller(t: int):
        for call in range(calls):
            try:
                got[t].append(tokens(work[t], call % 4 != 3))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"thread {t} call {call}: {type(exc).__name__}: {exc}")

    start = time.perf_counter()
    threads = [threading.Thread(target=caller, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    hf_paged.generate_batch(model, work[0], config)  # (lets the kept engine go)
    wrong = sum(result != expected[t] for t in range(2) for result in got[t])
    return {"threads": 2, "calls_each": calls, "returned": len(got[0]) + len(got[1]), "wrong": wrong,
            "errors": errors[:5], "seconds": round(time.perf_counter() - start, 2),
            "pass": not errors and wrong == 0 and len(got[0]) == len(got[1]) == calls}


# -- main ---------------------------------------------------------------------------------------------------------


def run(parts: tuple[str, ...], sizes: dict) -> dict:
    out = {}
    if "server" in parts or "grammar" in parts:
        with tiny_server() as (server, idle):
            if "server" in parts:
                out["server"] = part_server(server, idle, sizes)
            if "grammar" in parts:
                out["grammar"] = part_grammar(server, sizes)
    for name, part in (("workspace", part_workspace), ("signals", part_signals), ("threads", part_threads)):
        if name in parts:
            out[name] = part(sizes)
    return {name: out[name] for name in PARTS if name in out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS))
    parser.add_argument("--json", type=Path, metavar="F", help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="every part shrunk: a quick check that it runs")
    args = parser.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose among {', '.join(PARTS)}")
    torch.set_num_threads(1)
    sizes = SMOKE if args.smoke else FULL
    start, cpu = time.perf_counter(), time.process_time()
    results = run(parts, sizes)
    header = {**run_header("cpu"), "machine": "cpu", "cores": os.cpu_count(), "torch_threads": 1,
              "smoke": args.smoke, "sizes": sizes, "seconds": round(time.perf_counter() - start, 1),
              "probe_cpu_seconds": round(time.process_time() - cpu, 1)}
    doc = {**header, "parts": results, "pass": all(r["pass"] for r in results.values())}
    for name, result in results.items():
        print(f"{name}: {'pass' if result['pass'] else 'FAIL'}")
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0 if doc["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
