"""Stream tokens as the engine produces them: requests join and leave the running batch every step.

Runs on a CPU on SmolLM2-135M-Instruct (fetched and converted once on first use; the tiny random-init model, with a
note, where it cannot be had); ``--model tiny`` or ``--model PATH`` for another.
"""

import argparse

import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.cli.default_model import load_model, prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="smollm2 (the default), tiny, or a local HF checkpoint")
args = parser.parse_args()

model, tokenizer = load_model(args.model, "cuda" if torch.cuda.is_available() else "cpu")

engine = hf_paged.Engine(model, num_blocks=256, block_size=16, max_batch_tokens=512, tokenizer=tokenizer)
config = GenerationConfig(max_new_tokens=48, do_sample=True, temperature=0.8, top_p=0.95, seed=0)
prompts = ["Tell me a very short story about a robot.", "Say hello in French, Japanese and Chinese.",
           "Write a birthday message with emoji."]

texts = {}
for delta in engine.stream([prompt_ids(tokenizer, p) for p in prompts], config):  # a TokenDelta per request and step
    texts[delta.request_id] = texts.get(delta.request_id, "") + (delta.text or "")
    if delta.finished:
        print(f"request {delta.request_id} done ({delta.finish_reason}): {texts[delta.request_id]!r}")
print(engine.stats()["generated_tokens"], "tokens; all blocks free:",
      engine.stats()["free_blocks"] == engine.stats()["num_blocks"])
