"""Plain `model.generate` with compiled decode steps on a paged KV cache, then `hf_paged.optimize_generate`.

Give `PagedAttentionCache` the call's `max_new_tokens` and transformers' `generate` compiles its decode step by itself
(on CUDA, with CUDA graphs); `hf_paged.optimize_generate(model)` makes that step leaner (docs/guides/cache.md). Both
are checked against the eager paged run.

Runs on a CPU on SmolLM2-135M-Instruct (fetched and converted once on first use; the tiny random-init model, with a
note, where it cannot be had; `--model tiny` for it, `--model PATH` for another), compiled with torch.compile's
"eager" backend (transformers compiles only on CUDA unless its compile config says otherwise; on a CPU there are no
CUDA graphs, so this shows the API and checks the tokens, not the speed). Run on a CUDA GPU for the real thing.
"""

import argparse
import time

import torch
from transformers import CompileConfig

import hf_paged
from hf_paged.cli.default_model import load_model, prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="smollm2 (the default), tiny, or a local HF checkpoint")
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model, tokenizer = load_model(args.model, device)  # bfloat16 on a GPU, float32 on a CPU
if device == "cpu":
    cpu_compile = CompileConfig(backend="eager", mode=None)
    cpu_compile._compile_all_devices = True  # transformers compiles only on CUDA unless told
    model.generation_config.compile_config = cpu_compile

# A left-padded batch of prompts of different lengths (through the chat template, where the model has one).
prompts = ["Hi!", "What is the capital of France?", "Write a short poem about the sea, in four lines."]
batch = tokenizer.pad({"input_ids": [prompt_ids(tokenizer, p) for p in prompts]}, padding_side="left",
                      return_tensors="pt").to(device)
greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)


def run(label: str, **cache_kwargs) -> torch.Tensor:
    if device == "cpu" and "max_new_tokens" in cache_kwargs:
        cache_kwargs["compileable"] = True  # fixed-shape decode steps off CUDA too (see docs/guides/cache.md)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=256, block_size=16, device=device,
                                         dtype=model.dtype, **cache_kwargs)
    for call in ("first call", "second call"):  # a compiled path compiles in its first call
        start = time.perf_counter()
        out = model.generate(**hf_paged.with_cache(model, cache, **batch), **greedy)
        print(f"{label}, {call}: {time.perf_counter() - start:.2f} s, compileable={cache.is_compileable}")
    return out


eager = run("eager decode steps")
compiled = run("compiled decode steps", max_new_tokens=args.max_new_tokens)
hf_paged.optimize_generate(model)
optimized = run("compiled decode steps after optimize_generate", max_new_tokens=args.max_new_tokens)
print("compiled tokens == eager tokens:", torch.equal(compiled, eager))
print("optimized tokens == eager tokens:", torch.equal(optimized, eager))
for prompt, row in zip(prompts, optimized[:, batch["input_ids"].shape[1]:].tolist()):
    print(f"{prompt!r} -> {tokenizer.decode(row, skip_special_tokens=True)!r}")
