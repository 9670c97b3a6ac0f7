"""Moving from transformers' continuous batching to hf_paged's: two lines change.

    # before
    results = model.generate_batch(inputs, generation_config)
    # after
    import hf_paged
    results = hf_paged.generate_batch(model, inputs, generation_config)

Same inputs (lists of token ids), same result: ``{request_id: GenerationOutput}``. Runs on a CPU in seconds on
SmolLM2-135M-Instruct (fetched and converted once on first use; the tiny random-init model, with a note, where it
cannot be had); ``--model tiny`` or ``--model PATH`` for another.
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

prompts = ["What is the capital of France?", "Write a Python function that reverses a list.",
           "Explain in one sentence what a cache is."] * 4
inputs = [prompt_ids(tokenizer, p) for p in prompts]  # through the chat template, where the model has one
# As with transformers' generate_batch, the config given is the one used: name EOS (model.generate takes the model's).
generation_config = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=tokenizer.eos_token_id)

results = hf_paged.generate_batch(model, inputs, generation_config)  # was: model.generate_batch(inputs, ...)

for request_id, output in list(results.items())[:3]:
    print(request_id, repr(tokenizer.decode(output.generated_tokens, skip_special_tokens=True)))
print(f"{len(results)} requests, {sum(len(o.generated_tokens) for o in results.values())} tokens")
