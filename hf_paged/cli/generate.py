"""``hf-paged generate``: continuous batching over many prompts, with a progress bar and a summary.

With no arguments it runs on the embedded tiny random-init Llama (no download, CPU is enough); ``--model PATH``
loads a local checkpoint. Prompts come from arguments, ``--prompts-file`` (one per line) or stdin (``-``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import GenerationConfig

DEFAULT_PROMPTS = [
    "The paged KV cache splits memory into blocks",
    "Continuous batching lets requests join and leave",
    "Once upon a time, in a land of tensors,",
    "def fibonacci(n):",
]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate for many prompts with the continuous-batching engine")
    p.add_argument("prompts", nargs="*", help="prompts ('-' reads one per line from stdin)")
    p.add_argument("--model", help="local HF checkpoint (default: embedded tiny random-init Llama)")
    p.add_argument("--prompts-file", help="file with one prompt per line")
    p.add_argument("--num-prompts", type=int, default=32, help="with the default prompts: how many requests")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks (0 = size from free memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--backend", help="attention backends to allow, in order (e.g. 'cuda,torch')")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    p.add_argument("--show", type=int, default=3, help="print this many completions")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--verbose", action="store_true", help="log which backend serves each phase")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import hf_paged

    model, tokenizer = load(args)
    prompts = read_prompts(args)
    engine = hf_paged.Engine(model, num_blocks=args.num_blocks or None, block_size=args.block_size,
                             max_batch_tokens=args.max_batch_tokens, tokenizer=tokenizer, backend=args.backend)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed,
                              **(sampling if args.temperature > 0 else dict(do_sample=False)))
    start = time.perf_counter()
    outputs = engine.generate(prompts, config, progress_bar=not args.no_progress)
    elapsed = time.perf_counter() - start
    for prompt, out in list(zip(prompts, outputs))[: args.show]:
        print(f"{prompt!r} -> {out.text!r} [{out.finish_reason}]")
    print_summary(engine.stats(), outputs, elapsed)
    return 1 if any(o.finish_reason == "error" for o in outputs) else 0


def load(args: argparse.Namespace):
    from hf_paged.cli.default_model import load_model

    dtype = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    return load_model(args.model, args.device, dtype, args.seed)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts: list[str] = []
    for p in args.prompts:
        prompts += [line.rstrip("\n") for line in sys.stdin if line.strip()] if p == "-" else [p]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] + f" (request {i})" for i in range(args.num_prompts)]
    return prompts


def print_summary(stats: dict, outputs, elapsed: float) -> None:
    tokens = sum(len(o.token_ids) for o in outputs)
    errors = [o for o in outputs if o.finish_reason == "error"]
    rows = [
        ("requests", f"{len(outputs)}" + (f" ({len(errors)} failed: {errors[0].error})" if errors else "")),
        ("prompt tokens", stats["prompt_tokens"]),
        ("generated tokens", tokens),
        ("time", f"{elapsed:.2f} s"),
        ("tokens/s", f"{tokens / max(elapsed, 1e-9):.1f}"),
        ("peak blocks in use",
         f"{stats['peak_used_blocks']} of {stats['num_blocks']} (block size {stats['block_size']})"),
        ("preemptions", stats["preemptions"]),
        ("prefix-cache hits", f"{stats['prefix_cache_hit_tokens']} tokens"),
        ("attention backend", f"prefill {stats['prefill_backend']}, decode {stats['decode_backend']}"),
    ]
    print("summary:")
    for name, value in rows:
        print(f"  {name + ':':<20} {value}")
