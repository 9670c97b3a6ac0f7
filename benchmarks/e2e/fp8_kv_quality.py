"""How much an fp8 KV cache changes a real model's predictions, teacher-forced on the model's own continuation.

Each chat prompt gets a greedy continuation of ``--new-tokens`` tokens from the engine with the model-dtype cache
(EOS masked, so every continuation has its full length), with the log-probability of each chosen token: the
reference. Then prompt and reference go through the model on a ``PagedAttentionCache`` with the fp8 pool (e4m3, a
scale per layer and KV head): the prompt as one prefill, which fixes the fp8 scales as serving would, then the whole
continuation as a second chunk, every query of which reads its context from the pool (the torch backend gathers the
written K/V back, quantized, even for the chunk's own tokens), as a decode step would. At each continuation position
it compares: whether the fp8 run's most likely token is the reference token (top-1 agreement), and the absolute
difference of the log-probabilities the two give the reference token.

    python -m benchmarks.e2e.fp8_kv_quality  # SmolLM2-135M-Instruct on the CPU, 16 x 128 positions
    python -m benchmarks.e2e.fp8_kv_quality --model DIR --device cuda --json out.json

On a CPU the torch backend serves both runs (the oracle the GPU kernels are tested against); on a GPU the model runs
in bfloat16 and the backends that serve there read the pool.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.bench import run_header
from hf_paged.cli.default_model import load_model

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a refrigerator keeps food cold.",
    "Describe a walk through a busy market in Marrakech, with its sounds and smells.",
    "Give a step-by-step recipe for baking bread at home, and explain each step.",
    "Write a letter to a friend about your first week at a new job.",
    "Explain the water cycle to a ten-year-old, with examples.",
    "Tell the history of the bicycle, from its invention to today.",
    "Write an essay on why people enjoy music.",
    "Describe how to plant and care for a vegetable garden.",
    "Write a story about a cat who learns to play the piano.",
    "Explain how airplanes stay in the air.",
    "Describe your perfect holiday, day by day.",
    "Write a speech for the opening of a new library.",
    "Explain what a computer does when you press a key.",
    "Tell a fairy tale about a dragon and a baker.",
    "Give advice to a student starting university.",
]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def reference(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[hf_paged.RequestOutput]:
    """Greedy continuations on the model-dtype cache, exactly ``new_tokens`` long, with their log-probabilities."""
    engine = hf_paged.Engine(model, tokenizer=tokenizer,
                             num_blocks=len(prompts) * -(-(max(map(len, prompts)) + new_tokens) // 16))
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              output_logprobs=True)
    return engine.generate(prompts, config)


@torch.no_grad()
def continuation_logprobs(model, prompt: list[int], continuation: list[int], kv_cache_dtype: str | None):
    """Log-probabilities [len(continuation), vocab] of each continuation position, teacher-forced, with the KV cache
    in ``kv_cache_dtype`` (prompt prefilled first, then the continuation as one chunk reading the pool)."""
    total = len(prompt) + len(continuation)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=-(-total // 16), block_size=16, device=model.device,
                                         dtype=model.dtype, kv_cache_dtype=kv_cache_dtype)
    ids = torch.tensor([prompt + continuation], device=model.device)
    first = model(**hf_paged.with_cache(model, cache, input_ids=ids[:, : len(prompt)],
                                        attention_mask=torch.ones_like(ids[:, : len(prompt)])))
    rest = model(**hf_paged.with_cache(model, cache, input_ids=ids[:, len(prompt) : -1],
                                       attention_mask=torch.ones_like(ids[:, :-1])))
    logits = torch.cat([first.logits[0, -1:], rest.logits[0]]).float()
    return torch.log_softmax(logits, dim=-1)


def measure(model, tokenizer, prompts: list[str], new_tokens: int) -> dict:
    """Top-1 agreement and mean absolute log-probability difference of fp8 against the model-dtype KV cache."""
    ids = [chat_ids(tokenizer, p) for p in prompts]
    agree, diffs = [], []
    for prompt, ref in zip(ids, reference(model, tokenizer, ids, new_tokens)):
        fp8 = continuation_logprobs(model, prompt, ref.token_ids, "fp8")
        target = torch.tensor(ref.token_ids, device=fp8.device)
        agree.append(fp8.argmax(-1) == target)
        diffs.append((torch.tensor(ref.logprobs, device=fp8.device) - fp8.gather(-1, target[:, None])[:, 0]).abs())
    agree, diffs = torch.cat(agree), torch.cat(diffs)
    return {
        "positions": agree.numel(),
        "top1_agreement": agree.float().mean().item(),
        "mean_abs_logprob_diff": diffs.mean().item(),
        "max_abs_logprob_diff": diffs.max().item(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a local checkpoint directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=128, help="continuation length per prompt")
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, args.device)
    start = time.perf_counter()
    result = measure(model, tokenizer, PROMPTS, args.new_tokens)
    result.update(model=args.model, device=args.device, dtype=str(model.dtype), **run_header(args.device),
                  seconds=round(time.perf_counter() - start, 1))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
