"""On the GPU: models with sliding-window layers and logit softcapping, served by the cuda backend, give eager's greedy
tokens (bf16, the tie-aware rule of tests/gpu/greedy_oracle.py).

A Gemma2-like model (alternating sliding and full layers, softcapped scores), a Mistral-like one (every layer
windowed) and a Qwen2 with its upper layers windowed; windows of 64 tokens under prompts of up to 300, so the windows
cut. Gemma2's q projections are scaled up 4x so that its scores (~1 at random init) reach the cap of 5 and bend.
``model.generate`` at block sizes 16 and 256 and the engine (decode CUDA graphs included) with the backends restricted
to cuda then torch: the cuda backend must serve every phase and the KV write.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from greedy_oracle import NEW_TOKENS, assert_matches_up_to_ties, eager_run  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_paged
from hf_paged.hf.compat import with_cache

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

WINDOW = 64
COMMON = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=4, head_dim=128, sliding_window=WINDOW,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                    query_pre_attn_scalar=128)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "qwen2-windowed": ("Qwen2Config", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=2)),
}
ALLOWED = ("cuda", "torch")


def make_config(arch: str):
    cls_name, kwargs = ARCHS[arch]
    return getattr(transformers, cls_name)(**COMMON, **kwargs)


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(make_config(request.param), attn_implementation="eager",
                                             dtype=torch.bfloat16).cuda().eval()
    if request.param == "gemma2":
        with torch.no_grad():
            for layer in eager.model.layers:
                layer.self_attn.q_proj.weight.mul_(4.0)
    paged = AutoModelForCausalLM.from_config(make_config(request.param), attn_implementation="hf_paged",
                                             dtype=torch.bfloat16).cuda().eval()
    paged.load_state_dict(eager.state_dict())
    assert paged.config.sliding_window == WINDOW, request.param
    return eager, paged, request.param  # eager first: greedy_oracle's eager_run fixture reads models[0]


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 15, 63, 64, 65, 100, 300]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(3, COMMON["vocab_size"], (n,), generator=gen)
        mask[i, -n:] = 1
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}


@pytest.mark.parametrize("block_size", [16, 256])
def test_generate_matches_eager(models, batch, eager_run, block_size: int):
    _, paged, arch = models
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=512, block_size=block_size, device="cuda",
                                         dtype=torch.bfloat16, backend=ALLOWED)
    out = paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    served = cache.stats()["backends"]
    assert_matches_up_to_ties(out[:, batch["input_ids"].shape[1]:], *eager_run,
                              f"{arch} generate bs={block_size} served={served}")
    assert served["decode"] == "cuda" and served["prefill"] == "cuda" and served["write"] == "cuda", served


def test_engine_matches_eager(models, batch, eager_run):
    _, paged, arch = models
    prompts = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    engine = hf_paged.Engine(paged, num_blocks=512, block_size=16, max_batch_tokens=256, backend=",".join(ALLOWED))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    got = torch.tensor([o.token_ids for o in engine.generate(prompts, config)], device="cuda")
    stats = engine.stats()
    assert_matches_up_to_ties(got, *eager_run, f"{arch} engine stats={stats}")
    assert stats["free_blocks"] == stats["num_blocks"]
