"""Load an OpenAI-compatible server with N concurrent streaming clients over the anchor workload's prompts.

Works against ``hf-paged serve`` and ``transformers serve`` alike (token-id prompts on ``/v1/completions``, the
server's usage chunk for token counts). Reports output tokens/s over the whole run, time to first token and time
per output token (per request: (last chunk - first chunk) / (tokens - 1)) at p50/p99, as a table and JSON.

    hf-paged serve --model DIR &                 # the checkpoint should set no EOS, as the e2e benchmark's does
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --clients 64 --json serve_hf_paged.json

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_workloads import WORKLOADS  # noqa: E402


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
    start = time.perf_counter()
    first = last = None
    tokens, error = 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if "error" in chunk:
                error = chunk["error"].get("message")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or now
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None:
        return {"error": error or "no tokens"}
    return {"ttft": first - start, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "error": error}


async def run(args: argparse.Namespace) -> dict:
    workload = WORKLOADS[args.workload].smoke() if args.smoke else WORKLOADS[args.workload]
    prompts = workload.prompts(args.vocab_size)
    max_tokens = args.max_tokens or workload.new_tokens
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.clients)

        async def bounded(prompt: list[int]) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if args.ignore_eos:
                body["ignore_eos"] = True
            async with gate:
                return await one_request(client, args.url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        elapsed = time.perf_counter() - start
    done = [r for r in results if r.get("tokens")]
    ttft = [r["ttft"] for r in done]
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in done)
    return {"url": args.url, "model": model, "workload": workload.name, "clients": args.clients,
            "requests": len(results), "errors": sum(1 for r in results if r.get("error")),
            "output_tokens": tokens, "seconds": elapsed, "output_tok_per_s": tokens / elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99)}


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
