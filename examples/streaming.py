"""Stream tokens as the engine produces them: requests join and leave the running batch every step.

Runs on a CPU on the embedded tiny random-init Llama (its text is noise); pass ``--model PATH`` for a checkpoint.
"""

import argparse

import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.cli.default_model import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="local HF checkpoint (default: embedded tiny random-init Llama)")
args = parser.parse_args()

model, tokenizer = load_model(args.model, "cuda" if torch.cuda.is_available() else "cpu")

engine = hf_paged.Engine(model, num_blocks=256, block_size=16, max_batch_tokens=512, tokenizer=tokenizer)
config = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.95, seed=0)
prompts = ["Once upon a time", "The engine schedules", "Blocks of sixteen tokens"]

texts = {}
for delta in engine.stream(prompts, config):  # one TokenDelta per request per step
    texts[delta.request_id] = texts.get(delta.request_id, "") + (delta.text or "")
    if delta.finished:
        print(f"request {delta.request_id} done ({delta.finish_reason}): {texts[delta.request_id]!r}")
print(engine.stats()["generated_tokens"], "tokens; all blocks free:",
      engine.stats()["free_blocks"] == engine.stats()["num_blocks"])
