"""Kernel time of a tensor-parallel decode step by kind: matrix products, all-reduces, paged attention, the rest.

Run under ``torchrun`` on a model saved by ``python -m benchmarks.parallel.tensor_parallel --save --model-dir DIR``
(the Llama-3.1-8B shape, random bf16 weights)::

    python -m benchmarks.parallel.tensor_parallel --save --model-dir /path/to/m8b
    torchrun --standalone --nproc-per-node 2 -m benchmarks.parallel.tp_step_profile /path/to/m8b [--batches 1,64]

Each rank loads the model with ``tp_plan="auto"``; per batch size an ``hf_paged.Engine`` (the defaults a
tensor-parallel engine runs with: decode CUDA graphs, compiled layers) takes that many 512-token prompts, steps past
prefill, then times 20 decode steps (wall, synchronized) and profiles 10 more with the torch profiler. Rank 0 prints
the wall per step, the GPU time per step of each kind of kernel (by kernel name: cuBLAS/nvjet/skinny products,
collectives: NCCL's, torch's one-shot and hf_paged's ``peer_sum`` kernels, hf_paged's decode, everything else) and
the profiler's top kernels. ``HF_PAGED_TP_ALL_REDUCE`` in the environment picks the layers' all-reduce.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_paged

KINDS = (("all-reduce", ("nccl", "all_reduce", "peer_sum")), ("attention", ("paged_decode", "paged_prefill")),
         ("matrix products", ("gemm", "gemv", "skinny", "cutlass", "nvjet", "splitkreduce")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--batches", default="1,64")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, tp_plan="auto", attn_implementation="hf_paged",
                                                 dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for batch in map(int, args.batches.split(",")):
        engine = hf_paged.Engine(model, num_blocks=4096, block_size=16, max_batch_tokens=8192, max_num_seqs=batch)
        for _ in range(batch):
            engine.add_request(torch.randint(3, model.config.vocab_size, (512,), generator=gen).tolist(),
                               GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=None))
        while engine.scheduler.waiting or any(s.num_generated < 2 for s in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - began) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        if rank == 0:
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            per_kind: dict[str, float] = {}
            for e in kernels:
                per_kind[kind_of(e.name)] = per_kind.get(kind_of(e.name), 0.0) + e.time_range.elapsed_us() / 10
            graphs = engine.stats()["cuda_graphs"]
            print(f"batch {batch}: wall {wall_ms:.2f} ms per decode step, decode graphs "
                  f"{'on' if graphs else 'off'}; GPU us per step: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(per_kind.items())), flush=True)
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=70),
                  flush=True)
        engine.close()  # (its graphs hold NCCL collectives: destroy_process_group would wait for them)
        del engine
        torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
