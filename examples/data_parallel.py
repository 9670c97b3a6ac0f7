"""Data parallel: one engine per process, the prompts split by tokens, every process gets all the results.

    torchrun --nproc-per-node 2 examples/data_parallel.py          # or: accelerate launch --num-processes 2 ...
    python examples/data_parallel.py                                # one process: plain generate_batch

Each process loads the model on its own GPU (``LOCAL_RANK``), or on the CPU where there is none (then the processes
talk over gloo). Runs on a CPU in seconds on the embedded tiny random-init Llama; ``--model PATH`` for a local
checkpoint.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import GenerationConfig

import hf_paged
from hf_paged.cli.default_model import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="local HF checkpoint (default: embedded tiny random-init Llama)")
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

local_rank = int(os.environ.get("LOCAL_RANK", 0))
model, tokenizer = load_model(args.model, f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")

prompts = ["The capital of France is", "def quicksort(xs):", "Paged attention stores the KV cache in"] * 8
inputs = [tokenizer.encode(p) for p in prompts]
generation_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False)

results = hf_paged.distributed_generate_batch(model, inputs, generation_config)  # the same dict on every process

if int(os.environ.get("RANK", 0)) == 0:
    for request_id, output in list(results.items())[:3]:
        print(request_id, repr(tokenizer.decode(output.generated_tokens, skip_special_tokens=True)))
    print(f"{len(results)} requests, {sum(len(o.generated_tokens) for o in results.values())} tokens")

if dist.is_initialized():  # leave the process group before exit: a group torn down at interpreter exit can abort
    dist.destroy_process_group()
