"""``hf-paged generate``'s run: load the model, run the prompts through the engine, print answers and a summary.

Imported once the command line is parsed (``_generate.py`` holds the flags).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections import Counter

import torch
from transformers import GenerationConfig

from hf_paged.cli._arguments import flags_for_parameters
from hf_paged.cli._generate import DEFAULT_PROMPTS, engine_settings, prompt_lines
from hf_paged.cli.default_model import ModelUnavailable, choose_model, load_choice, prompt_ids
from hf_paged.engine import Engine, Workload

logger = logging.getLogger("hf_paged")


def run(args: argparse.Namespace) -> int:
    """Exit status 0, or 1 if some request failed (each failure is named in the summary)."""
    prompts = read_prompts(args)
    model, tokenizer = load(args)
    ids = [tokenizer.encode(p) if args.no_chat_template else prompt_ids(tokenizer, p) for p in prompts]
    # Automatic sizes fit these prompts: a pool sized from free memory alone takes GBs for a real model on a CPU.
    engine = build_engine(args, model, tokenizer, Workload(tuple(len(p) + args.max_new_tokens for p in ids)))
    how = (f"sampling (temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed})"
           if args.temperature > 0 else "greedy")
    logger.info("hf_paged: %d prompts, up to %d new tokens each%s, %s", len(prompts), args.max_new_tokens,
                " (EOS ignored)" if args.ignore_eos else "", how)
    for i, p in enumerate(ids, 1):  # refused before anything runs, named, never echoed: exit status 2
        if len(p) > engine.max_prompt_tokens:
            raise ValueError(f"prompt {i} is {len(p)} tokens long; this engine runs prompts of at most "
                             f"{engine.max_prompt_tokens} tokens (the model's positions, and the KV cache: num_blocks "
                             "x block_size); shorten it")
    shown = prompts if args.prompts or args.prompts_file else prompts[: args.show]  # (--show caps the demo only)
    start = time.perf_counter()
    bar = not args.no_progress and len(prompts) > 1  # (a bar over one request says nothing: its answer streams)
    outputs = (engine.generate(ids, generation_config(args), progress_bar=bar) if args.jsonl or bar
               else stream_answers(args, engine, ids, shown))
    elapsed = time.perf_counter() - start
    if args.jsonl:
        for text, out in zip(prompts, outputs):  # the prompt, the answer and how it ended
            print(json.dumps({"prompt": text, "text": out.text or "", "prompt_tokens": len(out.prompt_token_ids),
                              "generated_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
                              **({"error": out.error} if out.error is not None else {})}))
    elif bar:  # ``> prompt`` (cut to 200 characters), the answer as plain text, how it ended
        for text, out in zip(shown, outputs):
            print_prompt(text)
            print(printable(out.text or ""), end="")
            print_ending(args, out)
    print_summary(args, engine.stats(), outputs, elapsed, file=sys.stderr if args.jsonl else sys.stdout)
    return 1 if any(o.finish_reason == "error" for o in outputs) else 0


def build_engine(args: argparse.Namespace, model, tokenizer, workload: Workload | None = None) -> Engine:
    """The engine of the engine flags (``generate``'s and ``serve``'s). The engine refuses a ``--backend`` list that
    cannot serve the model when it builds its cache: that refusal is given in the flag's words, why each backend
    cannot serve (the dispatcher's reasons, without its record of the attention call) and what to do."""
    try:
        return Engine(model, tokenizer=tokenizer, workload=workload, **engine_settings(args))
    except NotImplementedError as exc:
        if args.backend is None:
            raise
        reasons = re.sub(r"^no attention backend can serve AttentionCall\([^()]*\): ", "", str(exc))
        reasons = re.sub(r"\. Allow more backends .*$", "", reasons)
        flag = ",".join(args.backend)
        raise NotImplementedError(f"--backend {flag} cannot run this model on {model.device.type} ({reasons}); "
                                  "leave --backend out to let hf_paged choose, or add torch "
                                  f"(--backend {flag},torch)") from exc


def stream_answers(args: argparse.Namespace, engine: Engine, ids: list[list[int]], shown: list[str]) -> list:
    """``engine.generate``'s outputs, with the answers to ``shown`` (the first prompts) printed as the progress bar's
    run prints them at its end, in prompt order, while they are generated: the first answer not printed whole
    streams as its tokens come, the ones after it follow once it is done. (Without a progress bar only: the bar's
    redraws would overwrite the line being streamed.)"""
    rids = engine.add_requests(ids, generation_config(args))
    texts, done = dict.fromkeys(rids, ""), {}
    head, printed = 0, None  # the answer being printed, and its text printed so far (None: its prompt not yet)
    while len(done) < len(rids):
        outputs, deltas = engine.step_with_deltas()
        for delta in deltas:
            texts[delta.request_id] += delta.text or ""
        done.update((out.request_id, out) for out in outputs)
        while head < len(shown):
            rid = rids[head]
            if printed is None:
                print_prompt(shown[head])
                printed = ""
            text = (done[rid].text or "") if rid in done else texts[rid]
            print(printable(text[len(printed):]), end="", flush=True)
            printed = text
            if rid not in done:
                break
            print_ending(args, done[rid])
            head, printed = head + 1, None
    return [done[rid] for rid in rids]


def print_prompt(prompt: str) -> None:
    print(f"> {printable(prompt if len(prompt) <= 200 else prompt[:197] + '...')}")


def print_ending(args: argparse.Namespace, out) -> None:
    """What follows an answer's text: the end of its line, a note where it did not end by itself, a blank line."""
    print()
    if out.finish_reason == "length":
        print(f"(cut at --max-new-tokens {args.max_new_tokens})")
    elif out.finish_reason == "error":
        print(f"(failed: {flags_for_parameters(out.error or 'unknown error', args)})")
    elif out.finish_reason != "stop":
        print(f"({out.finish_reason})")
    print()


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab escaped (``\\x1b``), so that a model's output
    cannot move the cursor or recolour the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def load(args: argparse.Namespace):
    """``(model, tokenizer)`` of ``--model``, logged (``--verbose``); sets ``args.model_name`` to the name it goes by
    (``generate``'s and ``serve``'s)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        choice = choose_model(args.model, device)
        model, tokenizer = load_choice(choice, device, None if args.dtype == "auto" else getattr(torch, args.dtype),
                                       args.seed)
    except ModelUnavailable as exc:  # --model smollm2, asked for by name
        raise ValueError(f"--model {args.model}: {exc}") from exc
    except (OSError, ValueError) as exc:  # transformers' words for a checkpoint it cannot read
        raise ValueError(f"--model {args.model}: cannot load it: {exc}") from exc
    args.model_name = choice.name
    logger.info("hf_paged: model %s (%s, %.1fM parameters, %s on %s)", choice.name, type(model).__name__,
                sum(p.numel() for p in model.parameters()) / 1e6, model.dtype, model.device)
    return model, tokenizer


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed,
                            min_new_tokens=args.max_new_tokens if args.ignore_eos else None,
                            **(sampling if args.temperature > 0 else dict(do_sample=False)))


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts in the order given (arguments, stdin at its ``-``, then the file), else the demo prompts."""
    prompts: list[str] = []
    for p in args.prompts:  # (stdin is read as bytes and decoded as UTF-8, whatever the locale)
        prompts += prompt_lines(getattr(sys.stdin, "buffer", sys.stdin).read(), "stdin ('-')") if p == "-" else [p]
    prompts += args.prompts_file or []
    return prompts or [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(args.num_prompts)]


def print_summary(args: argparse.Namespace, stats: dict, outputs, elapsed: float, file=None) -> None:
    tokens = sum(len(o.token_ids) for o in outputs)
    reasons = Counter(o.finish_reason for o in outputs)
    rows = [
        ("requests", f"{len(outputs)} (" + ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) + ")"),
        ("prompt tokens", stats["prompt_tokens"]),
        ("generated tokens", tokens),
        ("time", f"{elapsed:.2f} s"),
        ("tokens/s", f"{tokens / max(elapsed, 1e-9):.1f}"),
        ("peak blocks in use",
         f"{stats['peak_used_blocks']} of {stats['num_blocks']} (block size {stats['block_size']})"),
        ("preemptions", stats["preemptions"]),
        ("prefix-cache hits", f"{stats['prefix_cache_hit_tokens']} tokens"),
        ("attention backend", ", ".join(f"{phase} {name}" for phase, name in stats["backends"].items())
         if args.verbose else f"prefill {stats['prefill_backend'] or '-'}, decode {stats['decode_backend'] or '-'}"),
    ]
    if errors := [o for o in outputs if o.finish_reason == "error"]:
        rows.insert(1, ("first error", flags_for_parameters(errors[0].error, args)))
    if args.verbose:
        rows += [("steps", stats["steps"]),
                 ("host ms per step", ", ".join(f"{phase} {ms:.2f}" for phase, ms in stats["ms_per_step"].items()))]
    print("summary:", file=file)
    for name, value in rows:
        print(f"  {name + ':':<20} {value}", file=file)
