"""On the GPU: greedy tokens of `model.generate` and of the engine with each backend equal eager's (bf16).

bf16 rounding differs between attention implementations, so two correct paths may pick different tokens where
the top two logits are within rounding of each other. A run passes when its tokens equal eager's up to the first
step where eager's own top-2 logit gap is below ``TIE_GAP`` (and the rest is then not compared); any earlier
difference fails (tests/gpu/greedy_oracle.py). The test prints how many tokens matched exactly.
"""

from __future__ import annotations

import pytest
import torch
from greedy_oracle import NEW_TOKENS, assert_matches_up_to_ties, batch, eager_run, models  # noqa: F401 (fixtures)
from transformers import GenerationConfig

import hf_paged
from hf_paged.hf.compat import with_cache

# (allowed backends, block size): which path serves prefill / decode
RUNS = [
    (("torch",), 16),
    (("cuda", "torch"), 16),
    (("cuda", "torch"), 256),
    (("flash", "torch"), 256),
    (("flash", "cuda", "torch"), 16),
]


@pytest.mark.parametrize("allowed, block_size", RUNS)
def test_generate_matches_eager(models, batch, eager_run, allowed, block_size):
    if "flash" in allowed:
        pytest.importorskip("flash_attn")
    _, paged = models
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=512, block_size=block_size, device="cuda",
                                         dtype=torch.bfloat16, backend=allowed)
    out = paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    served = cache.stats()["backends"]
    label = f"generate {allowed} bs={block_size} served={served}"
    assert_matches_up_to_ties(out[:, batch["input_ids"].shape[1]:], *eager_run, label)
    if allowed[0] == "cuda":
        assert served["decode"] == "cuda" and served["write"] == "cuda", served
    if allowed[0] == "flash":
        assert served["prefill"] == "flash", served


@pytest.mark.parametrize("allowed, block_size", RUNS)
def test_engine_matches_eager(models, batch, eager_run, allowed, block_size):
    if "flash" in allowed:
        pytest.importorskip("flash_attn")
    _, paged = models
    prompts = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    engine = hf_paged.Engine(paged, num_blocks=512, block_size=block_size, max_batch_tokens=256,
                             backend=",".join(allowed))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    outs = engine.generate(prompts, config)
    got = torch.tensor([o.token_ids for o in outs], device="cuda")
    stats = engine.stats()
    assert_matches_up_to_ties(got, *eager_run, f"engine {allowed} bs={block_size} stats={stats}")
    assert stats["free_blocks"] == stats["num_blocks"]
