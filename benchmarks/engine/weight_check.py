"""What a kept engine's weight check costs per ``generate_batch`` call, against resetting its prefix cache every call.

A kept engine (``persistent_manager=True``, what ``hf_paged.integrations.trl`` uses) runs
``EngineCore.check_weights()`` once per call (every parameter's identity, storage, dtype and device, and a sample of
64 values of each) and compares the sum of the parameters' version counters before every step; together they find
the changes of the weights that make the cached KV stale. The alternative, ``reset_prefix_cache=True`` at every call
(or once per trainer step from a callback), needs no check but forgets every cached prefix, also where the weights
did not change.

Measured on SmolLM2-135M-Instruct (float32 on the CPU), with the host clock:

- ``check_weights`` and ``version sum``: each alone, the median of many calls on the kept engine.
- a rollout call, ``--prompts`` prompts of ``--copies`` identical copies each (a trainer's completions per prompt),
  ``--new-tokens`` greedy tokens; each call's prompts are new but share a ``--prefix``-token head (a system prompt).
  Four cases, each the median of ``--calls`` calls: ``check`` and ``reset`` with the weights unchanged between calls
  (the check keeps the cached head, a reset prefills it again), and both after a fused AdamW step before each call
  (the trainer's case: nothing cached holds, so the two do the same work and differ by the check alone). The step
  itself is outside the timed span.

    python -m benchmarks.engine.weight_check [--calls 5] [--threads 2] [--smoke]

``--smoke`` runs every path on the tiny random-init model with small sizes; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged import _compat
from hf_paged.cli.default_model import SMOLLM2, TINY, choose_model, load_choice
from hf_paged.engine._generate_batch import _KEPT


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5, help="timed calls per case (default 5)")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per call (default 8)")
    p.add_argument("--copies", type=int, default=4, help="identical copies of each prompt (default 4)")
    p.add_argument("--prefix", type=int, default=96, help="tokens of the head every prompt shares (default 96)")
    p.add_argument("--tail", type=int, default=32, help="tokens of each prompt's own part (default 32)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per completion (default 8)")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--smoke", action="store_true", help="the tiny model and small sizes, to check every path runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.calls, args.prompts, args.copies, args.prefix, args.tail, args.new_tokens = 2, 2, 2, 20, 4, 2
    if min(args.calls, args.prompts, args.copies, args.prefix, args.tail, args.new_tokens) < 1:
        p.error("--calls, --prompts, --copies, --prefix, --tail and --new-tokens must be 1 or more")
    return args


def median_us(fn, repeats: int) -> float:
    """The median time of ``fn()`` in microseconds over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_choice(choose_model(TINY if args.smoke else SMOLLM2), dtype=torch.float32,
                           attn_implementation="sdpa")
    vocab = model.config.vocab_size
    draw = random.Random(0)
    head = [draw.randrange(3, vocab) for _ in range(args.prefix)]
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def call(reset: bool) -> float:
        """One timed rollout call of new prompts on the kept engine; its seconds."""
        prompts = [head + [draw.randrange(3, vocab) for _ in range(args.tail)] for _ in range(args.prompts)]
        start = time.perf_counter()
        hf_paged.generate_batch(model, [p for p in prompts for _ in range(args.copies)], config,
                                persistent_manager=True, reset_prefix_cache=reset)
        return time.perf_counter() - start

    def step() -> None:
        """A fused AdamW step on zero gradients: the weight decay changes every weight, as a real step does."""
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    call(reset=False)  # (builds the engine and pages the weights in)
    engine = model.__dict__[_KEPT][1]
    results = {"check_weights us": median_us(engine.check_weights, 200),
               "version sum us": median_us(lambda: _compat.version_sum(engine.weights.params), 200)}
    for case, stepped in (("unchanged", False), ("after a step", True)):
        for reset in (False, True):
            seconds = []
            for _ in range(args.calls):
                if stepped:
                    step()
                seconds.append(call(reset))
            results[f"{case}, {'reset' if reset else 'check'}: call s"] = statistics.median(seconds)
    assert model.__dict__[_KEPT][1] is engine, "the engine was not kept: the calls measured a new one each"

    print(f"{len(list(model.parameters()))} parameter tensors; a call: {args.prompts} prompts x {args.copies} copies "
          f"of {args.prefix} + {args.tail} tokens, {args.new_tokens} new tokens; {torch.get_num_threads()} threads")
    for name, value in results.items():
        print(f"{name:>28}: {value:10.4f}")
    return results


if __name__ == "__main__":
    main()
