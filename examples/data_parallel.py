"""Data parallel: one engine per process, the prompts split by tokens, every process gets all the results.

    torchrun --nproc-per-node 2 examples/data_parallel.py          # or: accelerate launch --num-processes 2 ...
    python examples/data_parallel.py                                # one process: plain generate_batch

Each process loads the model on its own GPU (``LOCAL_RANK``), or on the CPU where there is none (then the processes
talk over gloo). Runs on a CPU on SmolLM2-135M-Instruct (fetched and converted once on first use; the tiny
random-init model, with a note, where it cannot be had); ``--model tiny`` or ``--model PATH`` for another.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import GenerationConfig

import hf_paged
from hf_paged.cli.default_model import load_model, prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="smollm2 (the default), tiny, or a local HF checkpoint")
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

local_rank = int(os.environ.get("LOCAL_RANK", 0))
model, tokenizer = load_model(args.model, f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")

prompts = ["What is the capital of France?", "Write a Python function that reverses a list.",
           "Explain in one sentence what a cache is."] * 8
inputs = [prompt_ids(tokenizer, p) for p in prompts]  # through the chat template, where the model has one
generation_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                                     eos_token_id=tokenizer.eos_token_id)  # the config given is the one used

results = hf_paged.distributed_generate_batch(model, inputs, generation_config)  # the same dict on every process

if int(os.environ.get("RANK", 0)) == 0:
    for request_id, output in list(results.items())[:3]:
        print(request_id, repr(tokenizer.decode(output.generated_tokens, skip_special_tokens=True)))
    print(f"{len(results)} requests, {sum(len(o.generated_tokens) for o in results.values())} tokens")

if dist.is_initialized():  # leave the process group before exit: a group torn down at interpreter exit can abort
    dist.destroy_process_group()
