"""The RL rollout pattern on one GPU: an optimizer step, then the step's rollouts, round after round.

What TRL's GRPO and RLOO trainers do on their continuous-batching path (``use_transformers_continuous_batching``),
without TRL: each of ``--rounds`` (5) rounds takes one fused AdamW step on the model (the loss of a random batch,
backward, ``torch.optim.AdamW(fused=True)``) and then makes TRL's call,
``model.generate_batch(prompt_ids, generation_config=..., continuous_batching_config=ContinuousBatchingConfig(
max_memory_percent=0.5), progress_bar=False)``, with each of ``--prompts`` (64) prompts sent ``--completions`` (8)
times, as TRL sends them, sampled (temperature 1, no top-k or top-p, TRL's defaults), ``--new-tokens`` (256) each and
no EOS, so every system does the same work. Prompts: 128-512 random tokens (seed 0).

Systems (``--systems``, run one after the other in this process, each on the same starting weights with an
optimizer of its own):
  hf_paged      ``hf_paged.integrations.trl.enable_generate_batch(model)``: the call runs on hf_paged's engine,
                kept on the model from round to round (what ``use_hf_paged(trainer)`` sets up)
  transformers  transformers' own ``model.generate_batch``, as TRL calls it

Per round: ``step_s`` (the optimizer step), ``generate_s`` (the call), ``tokens`` (new tokens returned: every
system must return them all), ``tokens_per_s``; and, counted from the end of the first round (whose compiles and
captures are the run's start-up), ``recompiles`` (torch._dynamo's new graphs: ``counters["stats"]["unique_graphs"]``)
and ``captures`` (CUDA graphs captured: calls of ``torch.cuda.CUDAGraph.capture_begin``), both expected 0 for
hf_paged after the first round. The table printed last gives each system's first round, its later rounds' mean
and hf_paged's speed-up over transformers on the later rounds.

    python -m benchmarks.e2e.rl_rollout [--systems hf_paged,transformers] [--rounds 5] [--prompts 64]
        [--completions 8] [--new-tokens 256] [--settings JSON] [--json F] [--smoke]

The model: the end-to-end benchmark's Llama-3.2-1B-shaped random-init model (``benchmarks/e2e/workloads.py``) in
bfloat16 on CUDA. ``--smoke`` runs every path on the CPU with that benchmark's tiny shape in float32 (2 rounds, 2
prompts x 2 completions, 4 new tokens, 16 KV blocks); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from unittest import mock

import torch
from torch._dynamo.utils import counters
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks import comma_names
from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, load_model
from hf_paged.bench import run_header
from hf_paged.integrations.trl import TRL_MEMORY_PERCENT, disable_generate_batch, enable_generate_batch

SYSTEMS = ("hf_paged", "transformers")
TRAIN_BATCH = (4, 256)  # rows x tokens of the optimizer step's random batch (smoke: 2 x 16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    p.add_argument("--rounds", type=int, help="optimizer step + rollouts rounds (default 5; smoke 2)")
    p.add_argument("--prompts", type=int, help="distinct prompts per round (default 64; smoke 2)")
    p.add_argument("--completions", type=int, help="completions per prompt (default 8; smoke 2)")
    p.add_argument("--new-tokens", type=int, help="new tokens per completion (default 256; smoke 4)")
    p.add_argument("--settings", default="{}", help="JSON dict of hf_paged's settings, given to enable_generate_batch "
                   "(transformers' ContinuousBatchingConfig names or hf_paged's own; default: none)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check every path runs")
    args = p.parse_args(argv)
    args.systems = comma_names(args.systems, SYSTEMS, "--systems", p.error)
    try:
        args.settings = json.loads(args.settings)
    except json.JSONDecodeError as e:
        p.error(f"--settings is not JSON: {e}")
    if not isinstance(args.settings, dict):
        p.error(f"--settings must be a JSON object, got {args.settings!r}")
    for name, full, smoke in (("rounds", 5, 2), ("prompts", 64, 2), ("completions", 8, 2), ("new_tokens", 256, 4)):
        value = getattr(args, name) or (smoke if args.smoke else full)
        if value < 1 or (name == "rounds" and value < 2):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'rounds' else 1}, got {value}")
        setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.smoke:
        raise SystemExit("rl_rollout measures a GPU; run it with --smoke on a CPU")
    if args.smoke:
        torch.set_num_threads(1)
    shape = SMOKE_SHAPE if args.smoke else LLAMA_1B
    model = load_model(shape, device, "sdpa")
    start = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    low, high = (8, 24) if args.smoke else (128, 512)
    prompts = [torch.randint(3, shape["vocab_size"], (int(n),), generator=gen).tolist()
               for n in torch.randint(low, high + 1, (args.prompts,), generator=gen)]
    rows_x_tokens = (2, 16) if args.smoke else TRAIN_BATCH
    train_batch = torch.randint(3, shape["vocab_size"], rows_x_tokens, generator=gen).to(device)
    meta = {**run_header(device), "model": "Llama-3.2-1B-shaped random init" if not args.smoke else "smoke",
            "dtype": str(next(model.parameters()).dtype), **{k: v for k, v in vars(args).items() if k != "json"}}
    rows = []
    with mock.patch.object(torch.cuda.CUDAGraph, "capture_begin", _counting(torch.cuda.CUDAGraph.capture_begin)):
        for system in args.systems:
            model.load_state_dict(start)
            gc.collect()  # (the system before lets its engine go: each starts with the same free memory)
            if device == "cuda":
                torch.cuda.empty_cache()
                meta.setdefault("free_gib_at_start", {})[system] = round(torch.cuda.mem_get_info()[0] / 2**30, 2)
            rows += run_system(system, model, prompts, train_batch, args)
    result = {"meta": meta, "rows": rows, "summary": summary(rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print_table(result["summary"])
    return result


_CAPTURES = [0]


def _counting(capture_begin):
    def counted(self, *args, **kwargs):
        _CAPTURES[0] += 1
        return capture_begin(self, *args, **kwargs)

    return counted


def run_system(system: str, model, prompts: list[list[int]], train_batch: torch.Tensor,
               args: argparse.Namespace) -> list[dict]:
    """``args.rounds`` rounds of (fused AdamW step, TRL's ``generate_batch`` call) on ``model`` with ``system``."""
    if system == "hf_paged":
        enable_generate_batch(model, **args.settings)
    else:
        disable_generate_batch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    batching = ContinuousBatchingConfig(max_memory_percent=TRL_MEMORY_PERCENT, num_blocks=16 if args.smoke else None)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                              eos_token_id=None, pad_token_id=0)
    sent = [p for p in prompts for _ in range(args.completions)]  # (TRL sends each prompt once per completion)
    rows, base = [], None
    try:
        for index in range(args.rounds):
            model.train()
            began = _now()
            model(input_ids=train_batch, labels=train_batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stepped = _now()
            with torch.no_grad():
                out = model.generate_batch(sent, generation_config=copy.deepcopy(config),
                                           continuous_batching_config=batching, progress_bar=False)
            done = _now()
            tokens = sum(len(o.generated_tokens) for o in out.values())
            if base is None:
                base = (counters["stats"]["unique_graphs"], _CAPTURES[0])
            rows.append({"system": system, "round": index, "step_s": round(stepped - began, 4),
                         "generate_s": round(done - stepped, 4), "tokens": tokens,
                         "expected_tokens": len(sent) * args.new_tokens,
                         "tokens_per_s": round(tokens / (done - stepped), 1),
                         "recompiles": counters["stats"]["unique_graphs"] - base[0],
                         "captures": _CAPTURES[0] - base[1]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        disable_generate_batch(model)
        del optimizer
    return rows


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def summary(rows: list[dict]) -> list[dict]:
    """Per system: the first round's call, the later rounds' mean call and throughput, and the recompiles and
    captures after the first round; hf_paged's speed-up over transformers on the later rounds where both ran."""
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        later = mine[1:]
        out.append({"system": system, "first_generate_s": mine[0]["generate_s"],
                    "later_generate_s": round(statistics.mean(r["generate_s"] for r in later), 4),
                    "later_tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in later), 1),
                    "all_tokens": all(r["tokens"] == r["expected_tokens"] for r in mine),
                    "recompiles": mine[-1]["recompiles"], "captures": mine[-1]["captures"]})
    by = {s["system"]: s for s in out}
    if {"hf_paged", "transformers"} <= set(by):
        by["hf_paged"]["speedup"] = round(by["transformers"]["later_generate_s"] / by["hf_paged"]["later_generate_s"],
                                          2)
    return out


def print_table(summary_rows: list[dict]) -> None:
    print(f"{'system':<14}{'first s':>10}{'later s':>10}{'tok/s':>12}{'recompiles':>12}{'captures':>10}{'speedup':>9}")
    for s in summary_rows:
        print(f"{s['system']:<14}{s['first_generate_s']:>10.3f}{s['later_generate_s']:>10.3f}"
              f"{s['later_tokens_per_s']:>12.1f}{s['recompiles']:>12}{s['captures']:>10}{s.get('speedup', ''):>9}")


if __name__ == "__main__":
    main()
