"""Data-parallel throughput: ``distributed_generate_batch`` on 1 and on N GPUs, one launch each, same work.

The anchor workload of ``benchmarks/e2e/throughput.py`` scaled to 512 requests (prompts of 128 to 1024 random tokens,
256 new tokens each, no EOS, greedy) on the same random-init bf16 Llama-3.2-1B shape; each process holds the whole model
on its own GPU and generates for its share of the prompts (balanced by tokens); every process gets every result. Time is
the wall clock of one call after a warm-up call (which compiles and captures), measured between barriers on rank 0.

    python -m benchmarks.parallel.data_parallel --gpus 1,2 --json dp.json  # torchrun for each count, then the table
    python -m benchmarks.parallel.data_parallel --smoke --gpus 1,2            # tiny model, CPU processes over gloo

A run that fails is reported and the others still run; the JSON is rewritten after each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

from benchmarks import child_env, module_command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2", help="comma list of process counts (one GPU each)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU processes (gloo), to check it runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One process of a launch: load, warm up, time one call; rank 0 writes the row to ``args.out``."""
    import torch
    import torch.distributed as dist
    from transformers import GenerationConfig

    import hf_paged
    from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, WARM, WORKLOADS, load_model
    from hf_paged.bench import run_header
    from hf_paged.integrations.accelerate import distributed_generate_batch

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    shape = SMOKE_SHAPE if args.smoke else LLAMA_1B
    anchor = dataclasses.replace(WORKLOADS["anchor"], num_requests=args.requests, take=None)
    warm = WARM
    if args.smoke:
        anchor, warm = anchor.smoke(), warm.smoke()
    model = load_model(shape, "cuda" if cuda else "cpu", hf_paged.ATTN_IMPLEMENTATION)
    config = GenerationConfig(max_new_tokens=anchor.new_tokens, do_sample=False, eos_token_id=None)
    warm_config = GenerationConfig(max_new_tokens=warm.new_tokens, do_sample=False, eos_token_id=None)
    prompts = anchor.prompts(shape["vocab_size"])
    distributed_generate_batch(model, warm.prompts(shape["vocab_size"]), warm_config)

    def barrier() -> None:
        if cuda:
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()

    barrier()
    start = time.perf_counter()
    results = distributed_generate_batch(model, prompts, config)
    barrier()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in results.values())
    if rank == 0:
        row = {"processes": world, "requests": len(prompts), "tokens": tokens,
               "expected_tokens": len(prompts) * anchor.new_tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
               **run_header("cuda" if cuda else "cpu"), "smoke": args.smoke}
        args.out.write_text(json.dumps(row))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(count: int, args: argparse.Namespace) -> dict:
    out = Path(args.json or "data_parallel.json").with_suffix(f".rank0_{count}.tmp")
    cmd = module_command("torch.distributed.run", "--standalone", f"--nproc-per-node={count}", "--module",
                         __spec__.name, "--worker", "--out", str(out), "--requests", str(args.requests))
    cmd += ["--smoke"] if args.smoke else []
    start = time.perf_counter()
    done = subprocess.run(cmd, env=child_env(), text=True, capture_output=True)
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return {"processes": count, "status": "failed", "error": " | ".join(tail)[-400:]}
    row = json.loads(out.read_text())
    out.unlink()
    row["status"] = "ok" if row["tokens"] == row["expected_tokens"] else "short"
    row["launch_seconds"] = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    counts = [int(c) for c in args.gpus.split(",")]
    rows: list[dict] = []
    begin = time.perf_counter()
    for count in counts:
        print(f"[{time.perf_counter() - begin:7.1f} s] {count} process(es), {args.requests} requests ...", flush=True)
        row = launch(count, args)
        rows.append(row)
        summary = (f"{row['tokens']:,} tokens in {row['seconds']:.2f} s = {row['tok_per_s']:,.0f} tok/s"
                   if row["status"] != "failed" else f"FAILED: {row['error']}")
        print(f"[{time.perf_counter() - begin:7.1f} s] {count} process(es): {summary}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    base = next((r["tok_per_s"] for r in rows if r.get("processes") == 1 and r["status"] == "ok"), None)
    print(f"\nData parallel, anchor scaled to {args.requests} requests; {rows[0].get('card', '?')}")
    print(f"{'processes':>10}{'tok/s':>12}{'vs 1':>8}")
    for r in rows:
        rate = r.get("tok_per_s")
        print(f"{r['processes']:>10}{(f'{rate:,.0f}' if rate else r['status']):>12}"
              f"{(f'{rate / base:.2f}x' if rate and base else ''):>8}")


if __name__ == "__main__":
    main()
