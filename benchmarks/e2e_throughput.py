"""End-to-end output tokens/s on the GPU: hf_paged's engine against transformers' continuous batching, one run.

The workload of ``shared/gpu/anchors.md``: a random-init bf16 Llama shaped like Llama-3.2-1B (hidden 2048, 16
layers, 32 heads, 8 kv heads, head_dim 64, intermediate 8192, vocab 128256, tied embeddings); 256 requests with
prompt lengths uniform in [128, 1024] (random token ids, seed 0); exactly 256 new tokens each; greedy. Time is the
wall clock of one ``generate_batch`` call after a smaller warm-up call. Baselines run in the same process on the
same weights.

    python benchmarks/e2e_throughput.py [--requests 256] [--new-tokens 256] [--baselines sdpa,flash] [--json F]
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def workload(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(128, 1025, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def load(attn: str, state=None, shape: dict = LLAMA_1B, device: str = "cuda"):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation=attn, dtype=dtype)
    model = model.to(device).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def timed(call, prompts, warm_prompts) -> tuple[float, int]:
    call(warm_prompts)
    _sync()
    start = time.perf_counter()
    out = call(prompts)
    _sync()
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.generated_tokens) for o in out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--baselines", default="sdpa", help="comma list of transformers CB baselines: sdpa, flash")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script runs")
    args = parser.parse_args()
    shape, device = LLAMA_1B, "cuda"
    if args.smoke:
        shape = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2000}
        device = "cpu"

    torch.manual_seed(0)
    prompts, warm = workload(args.requests, shape["vocab_size"]), workload(16, shape["vocab_size"], seed=1)
    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                              eos_token_id=2, pad_token_id=0)
    warm_config = GenerationConfig(max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=2,
                                   pad_token_id=0)
    rows = []

    model = load("hf_paged", shape=shape, device=device)
    state = model.state_dict()
    cb = lambda p: hf_paged.generate_batch(model, p, config if p is prompts else warm_config,
                                           continuous_batching_config=_cb_config(args.block_size))
    seconds, tokens = timed(cb, prompts, warm)
    rows.append(("hf_paged generate_batch", f"block_size {args.block_size}", tokens, seconds))
    del model
    torch.cuda.empty_cache()

    for name in filter(None, args.baselines.split(",")):
        attn = {"sdpa": "paged|sdpa", "flash": "paged|flash_attention_2"}[name]
        try:
            base = load(attn, state, shape=shape, device=device)
            call = lambda p: base.generate_batch(p, config if p is prompts else warm_config, progress_bar=False)
            seconds, tokens = timed(call, prompts, warm)
        except (ImportError, ValueError, RuntimeError) as exc:  # e.g. flash-attn missing: report, keep the others
            print(f"baseline {attn} did not run: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        rows.append(("transformers generate_batch", attn, tokens, seconds))
        del base
        torch.cuda.empty_cache()

    card = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
    print(f"\n{card}; {args.requests} requests, prompts 128-1024, "
          f"{args.new_tokens} new tokens, greedy, bf16 Llama-3.2-1B shape (random init)")
    print(f"{'system':<28} {'attention':<26} {'tokens':>8} {'seconds':>8} {'tokens/s':>10}")
    for system, attn, tokens, seconds in rows:
        print(f"{system:<28} {attn:<26} {tokens:>8} {seconds:>8.2f} {tokens / seconds:>10,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(system=s, attention=a, tokens=t, seconds=x) for s, a, t, x in rows], f, indent=1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cb_config(block_size: int):
    from types import SimpleNamespace

    return SimpleNamespace(block_size=block_size, num_blocks=None, max_batch_tokens=8192, max_requests_per_batch=256,
                           allow_block_sharing=True, return_logprobs=False, seed=None, max_memory_percent=0.8)


if __name__ == "__main__":
    main()
