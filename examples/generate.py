"""Plain `model.generate` on a paged KV cache, checked against eager attention.

Runs on a CPU in seconds: the model is a tiny random-init Llama built from a config (no download).
Pass `--model PATH` to use a local checkpoint instead.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_paged

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="local HF checkpoint (default: an embedded tiny random-init Llama)")
parser.add_argument("--block-size", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()

torch.manual_seed(0)
if args.model:
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="hf_paged")
    reference = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
else:
    config = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**config), attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), attn_implementation="hf_paged").eval()
    model.load_state_dict(reference.state_dict())

# A left-padded batch of prompts of different lengths.
lengths = [3, 17, 40, 64]
input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
attention_mask = torch.zeros_like(input_ids)
for i, n in enumerate(lengths):
    input_ids[i, -n:] = torch.randint(3, model.config.vocab_size, (n,))
    attention_mask[i, -n:] = 1
batch = dict(input_ids=input_ids, attention_mask=attention_mask)

cache = hf_paged.PagedAttentionCache(model.config, num_blocks=256, block_size=args.block_size,
                                     device=model.device, dtype=model.dtype)
greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
out = model.generate(**hf_paged.with_cache(model, cache, **batch), **greedy)
want = reference.generate(**batch, **greedy)

print("paged tokens == eager tokens:", torch.equal(out, want))
print("cache:", cache.stats())
for row in out[:, max(lengths):].tolist():
    print(row)
