"""The greedy oracles of the end-to-end GPU tests, and their rule for bf16 rounding ties.

bf16 rounding differs between attention implementations, so two correct paths may pick different tokens where the
top two logits are within rounding of each other. :func:`assert_matches_up_to_ties` passes a run whose tokens equal
the oracle's up to the first step where the oracle's own top-2 logit gap is below ``TIE_GAP`` (the rest of that row
is then not compared); any earlier difference fails. It returns how many tokens matched before any tie, and can
require a share of them (``min_exact``).

The oracles: eager attention on a small bf16 Llama (``CONFIG``; fixtures ``models``, ``batch`` and ``eager_run``), and
greedy ``generate`` over an fp8 cache served by the torch backend alone (:func:`torch_fp8_generate`, on
``bf16_model``). Importable without a GPU: the fixtures touch the device only when a test asks for them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_paged
from hf_paged.hf.compat import with_cache

TIE_GAP = 0.125  # a few bf16 ulps of logits of magnitude ~4
NEW_TOKENS = 24
CONFIG = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)


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


def assert_matches_up_to_ties(got: torch.Tensor, want: torch.Tensor, gaps: torch.Tensor, label: str,
                              min_exact: float = 0.0) -> int:
    """Fails at a row's first difference from ``want`` unless the oracle's top-2 gap there is below ``TIE_GAP``;
    returns the tokens equal to ``want`` before each row's first difference, and fails unless they are at least
    ``min_exact`` of all."""
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
    assert exact >= min_exact * want.numel(), (
        f"{label}: only {exact}/{want.numel()} tokens equal to eager before the rows part at rounding ties, fewer "
        f"than {min_exact:.0%}: rows part at near-ties far more often than correct paths do")
    return exact


@pytest.fixture(scope="module")
def bf16_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="hf_paged",
                                            dtype=torch.bfloat16).cuda().eval()


def prompts_of(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """The batch's rows without their left padding."""
    return [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]


def torch_fp8_generate(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: greedy generate over an fp8 cache served by the torch backend alone (its first forward, every
    prompt token, fixes the scales, as an engine's first step does when all prompts fit in it); the new tokens and
    each step's gap between the top two logits (for the tie rule)."""
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=512, block_size=16, device="cuda",
                                         dtype=torch.bfloat16, backend="torch", kv_cache_dtype="fp8")
    ref = model.generate(**with_cache(model, cache, **batch), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    top2 = torch.stack(ref.logits, 1).float().topk(2, dim=-1).values
    return ref.sequences[:, batch["input_ids"].shape[1]:], top2[..., 0] - top2[..., 1]
