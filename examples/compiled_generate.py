"""Plain `model.generate` with compiled decode steps on a paged KV cache, then `hf_paged.optimize_generate`.

Give `PagedAttentionCache` the call's `max_new_tokens` and transformers' `generate` compiles its decode step by itself
(on CUDA, with CUDA graphs); `hf_paged.optimize_generate(model)` makes that step leaner (docs/guides/cache.md). Both
are checked against the eager paged run.

Runs on a CPU in seconds: a tiny random-init float32 Llama built from a config, compiled with torch.compile's "eager"
backend (transformers compiles only on CUDA unless its compile config says otherwise; on a CPU there are no CUDA
graphs, so this shows the API and checks the tokens, not the speed). Pass `--model PATH` and run on a CUDA GPU for
the real thing.
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig

import hf_paged

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="local HF checkpoint (default: an embedded tiny random-init Llama)")
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
if args.model:
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="hf_paged", dtype=torch.bfloat16)
else:
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_paged")
model = model.to(device).eval()
if device == "cpu":
    cpu_compile = CompileConfig(backend="eager", mode=None)
    cpu_compile._compile_all_devices = True  # transformers compiles only on CUDA unless told
    model.generation_config.compile_config = cpu_compile

lengths = [3, 17, 40, 64]  # a left-padded batch of prompts of different lengths
input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
attention_mask = torch.zeros_like(input_ids)
for i, n in enumerate(lengths):
    input_ids[i, -n:] = torch.randint(3, model.config.vocab_size, (n,))
    attention_mask[i, -n:] = 1
batch = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


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
