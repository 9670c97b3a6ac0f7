"""Plain `model.generate` on a paged KV cache, checked against eager attention.

Runs on a CPU in seconds on SmolLM2-135M-Instruct (fetched and converted once on first use; the tiny random-init model,
with a note, where it cannot be had). `--model tiny` or `--model PATH` for another.
"""

import argparse

import torch

import hf_paged
from hf_paged.cli.default_model import choose_model, load_choice, prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="smollm2 (the default), tiny, or a local HF checkpoint")
parser.add_argument("--block-size", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()

choice = choose_model(args.model)
model, tokenizer = load_choice(choice)  # attn_implementation="hf_paged"
reference, _ = load_choice(choice, attn_implementation="eager")

# A left-padded batch of prompts of different lengths (through the chat template, where the model has one).
prompts = ["Hi!", "What is the capital of France?",
           "Here is a list of fruits: apple, banana, cherry, grape, lemon, mango, orange, pear, plum. Which of them "
           "are yellow, and which of them grow in Spain?"]
batch = tokenizer.pad({"input_ids": [prompt_ids(tokenizer, p) for p in prompts]}, padding_side="left",
                      return_tensors="pt")

cache = hf_paged.PagedAttentionCache(model.config, num_blocks=256, block_size=args.block_size,
                                     device=model.device, dtype=model.dtype)
greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
with torch.no_grad():
    out = model.generate(**hf_paged.with_cache(model, cache, **batch), **greedy)
    want = reference.generate(**batch, **greedy)

print("paged tokens == eager tokens:", torch.equal(out, want))
print("cache:", cache.stats())
for prompt, row in zip(prompts, out[:, batch["input_ids"].shape[1]:].tolist()):
    print(f"{prompt!r} -> {tokenizer.decode(row, skip_special_tokens=True)!r}")
