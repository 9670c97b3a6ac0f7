"""Moving from transformers' continuous batching to hf_paged's: two lines change.

    # before
    results = model.generate_batch(inputs, generation_config)
    # after
    import hf_paged
    results = hf_paged.generate_batch(model, inputs, generation_config)

Same inputs (lists of token ids), same result: ``{request_id: GenerationOutput}``. Runs on a CPU in seconds on the
embedded tiny random-init Llama; pass ``--model PATH`` for a local checkpoint.
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

prompts = ["The capital of France is", "def quicksort(xs):", "Paged attention stores the KV cache in"] * 4
inputs = [tokenizer.encode(p) for p in prompts]
generation_config = GenerationConfig(max_new_tokens=24, do_sample=False)

results = hf_paged.generate_batch(model, inputs, generation_config)  # was: model.generate_batch(inputs, ...)

for request_id, output in list(results.items())[:3]:
    print(request_id, repr(tokenizer.decode(output.generated_tokens, skip_special_tokens=True)))
print(f"{len(results)} requests, {sum(len(o.generated_tokens) for o in results.values())} tokens")
