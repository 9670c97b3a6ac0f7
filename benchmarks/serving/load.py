"""Load an OpenAI-compatible server with N concurrent streaming clients over the anchor workload's prompts.

Sends token-id prompts to ``/v1/completions`` and counts tokens from the server's usage chunk. Reports output
tokens/s over the whole run, time to first token and time per output token (per request: (last chunk - first
chunk) / (tokens - 1)) at p50/p99, as a table and JSON. ``transformers serve`` takes text prompts only:
``benchmarks/serving/compare.py`` starts both servers on a checkpoint whose tokenizer reads its text prompts back as
these ids, and drives them with :func:`drive`.

    hf-paged serve --model DIR &                 # the checkpoint should set no EOS, as the e2e benchmark's does
    python -m benchmarks.serving.load --url http://127.0.0.1:8000 --clients 64 --json serve_hf_paged.json

``--smoke`` scales the workload down for the embedded tiny model on the CPU (``--vocab-size 259``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.e2e.workloads import WORKLOADS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's base URL (without /v1)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="anchor")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--vocab-size", type=int, default=128256, help="prompt token ids are drawn below this")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default: the workload's)")
    p.add_argument("--ignore-eos", action="store_true", help="send hf-paged's ignore_eos extension")
    p.add_argument("--smoke", action="store_true", help="the workload scaled down for a tiny CPU model")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: time to the first text chunk, time per output token after it
    ((last chunk - first chunk) / (tokens - 1)), and the token counts of the server's usage chunk."""
    start = time.perf_counter()
    first = last = None
    tokens = prompt_tokens = chunks = 0
    error = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if "error" in chunk:
                error = str(chunk["error"].get("message") if isinstance(chunk["error"], dict) else chunk["error"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or now
                last = now
                chunks += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    if first is None:
        return {"error": error or "no tokens"}
    return {"ttft": first - start, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "prompt_tokens": prompt_tokens, "chunks": chunks, "error": error}


async def drive(url: str, model: str, prompts: list, max_tokens: int, clients: int, timeout: float,
                extra_body: dict | None = None, log=None, log_every_s: float = 10.0) -> dict:
    """Send ``prompts`` (strings or token-id lists, in order) from ``clients`` concurrent streaming clients, greedy,
    ``max_tokens`` each; the summary of :func:`summarize`. ``log`` (if given) hears how far it got every
    ``log_every_s`` seconds."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    gate = asyncio.Semaphore(clients)
    results: list[dict] = []

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        async def bounded(prompt) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, **(extra_body or {})}
            async with gate:
                result = await one_request(client, url, body)
            results.append(result)
            return result

        async def report() -> None:
            while True:
                await asyncio.sleep(log_every_s)
                log(f"  {len(results)}/{len(prompts)} requests done, {sum(r.get('tokens', 0) for r in results)} "
                    f"tokens, {time.perf_counter() - start:.0f} s")

        start = time.perf_counter()
        reporter = asyncio.create_task(report()) if log else None
        try:
            ordered = await asyncio.gather(*(bounded(p) for p in prompts))
        finally:
            if reporter:
                reporter.cancel()
        elapsed = time.perf_counter() - start
    return summarize(ordered, elapsed, max_tokens)


def summarize(results: list[dict], elapsed: float, max_tokens: int) -> dict:
    """Output tokens/s over the whole run, TTFT and TPOT p50/p99 (ms), and how many requests failed or ended
    before ``max_tokens``."""
    done = [r for r in results if r.get("tokens")]
    ttft = [r["ttft"] for r in done]
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in done)
    return {"requests": len(results), "errors": sum(1 for r in results if r.get("error")),
            "short": sum(1 for r in done if r["tokens"] != max_tokens),
            "prompt_tokens": sum(r["prompt_tokens"] for r in done), "output_tokens": tokens, "seconds": elapsed,
            "output_tok_per_s": tokens / elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99)}


async def run(args: argparse.Namespace) -> dict:
    workload = WORKLOADS[args.workload].smoke() if args.smoke else WORKLOADS[args.workload]
    max_tokens = args.max_tokens or workload.new_tokens
    async with httpx.AsyncClient(timeout=args.timeout, trust_env=False) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
    summary = await drive(args.url, model, workload.prompts(args.vocab_size), max_tokens, args.clients, args.timeout,
                          {"ignore_eos": True} if args.ignore_eos else None)
    return {"url": args.url, "model": model, "workload": workload.name, "clients": args.clients, **summary}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    for key, value in result.items():
        print(f"{key:<18} {value:.2f}" if isinstance(value, float) else f"{key:<18} {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
