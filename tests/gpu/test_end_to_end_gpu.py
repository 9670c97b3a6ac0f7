"""On the GPU: greedy tokens of `model.generate` and of the engine with each backend equal eager's (bf16).

bf16 rounding differs between attention implementations, so two correct paths may pick different tokens where
the top two logits are within rounding of each other. A run passes when its tokens equal eager's up to the first
step where eager's own top-2 logit gap is below ``TIE_GAP`` (and the rest is then not compared); any earlier
difference fails. The test prints how many tokens matched exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged
from hf_paged.hf.compat import with_cache

pytestmark = pytest.mark.cuda

TIE_GAP = 0.125  # a few bf16 ulps of logits of magnitude ~4
NEW_TOKENS = 24
CONFIG = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# (allowed backends, block size): which path serves prefill / decode
RUNS = [
    (("torch",), 16),
    (("cuda", "torch"), 16),
    (("cuda", "torch"), 256),
    (("flash", "torch"), 256),
    (("flash", "cuda", "torch"), 16),
]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="eager",
                                             dtype=torch.bfloat16).cuda().eval()
    paged = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="hf_paged",
                                             dtype=torch.bfloat16).cuda().eval()
    paged.load_state_dict(eager.state_dict())
    return eager, paged


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 15, 16, 17, 100, 300]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(3, CONFIG["vocab_size"], (n,), generator=gen)
        mask[i, -n:] = 1
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}


@pytest.fixture(scope="module")
def eager_run(models, batch):
    out = models[0].generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None,
                             return_dict_in_generate=True, output_logits=True)
    top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values  # [B, steps, 2]
    return out.sequences[:, batch["input_ids"].shape[1]:], top2[..., 0] - top2[..., 1]


def assert_matches_up_to_ties(got: torch.Tensor, want: torch.Tensor, gaps: torch.Tensor, label: str) -> None:
    exact = 0
    for row in range(want.shape[0]):
        diff = (got[row] != want[row]).nonzero()
        first = int(diff[0]) if diff.numel() else want.shape[1]
        exact += first
        if first < want.shape[1]:
            assert gaps[row, first] < TIE_GAP, (
                f"{label}: row {row} differs from eager at step {first} where eager's top-2 gap is "
                f"{float(gaps[row, first]):.3f} (not a rounding tie)"
            )
    print(f"{label}: {exact}/{want.numel()} tokens equal to eager before any rounding tie")


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
