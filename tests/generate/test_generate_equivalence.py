"""Greedy and beam-search ``generate`` on the paged cache give eager's tokens, for every covered architecture."""

from __future__ import annotations

import zlib

import pytest
import torch
from tiny_models import ARCHS, EOS, PAD, left_padded_batch, make_models

import hf_paged
from hf_paged.hf.compat import with_cache

GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


def _paged_cache(model, block_size: int, num_blocks: int = 256) -> hf_paged.PagedAttentionCache:
    return hf_paged.PagedAttentionCache(
        model.config, num_blocks=num_blocks, block_size=block_size, device=model.device, dtype=model.dtype
    )


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_matches_eager(arch: str, block_size: int):
    eager, paged = make_models(arch, seed=zlib.crc32(f"{arch}/{block_size}".encode()) % 1000)  # not hash(): PYTHONHASHSEED
    gen = torch.Generator().manual_seed(block_size)
    lengths = [1, 7, 33, 100] if block_size == 16 else [5, 17, 64]
    batch = left_padded_batch(lengths, gen)
    want = eager.generate(**batch, max_new_tokens=12, **GREEDY)
    cache = _paged_cache(paged, block_size)
    got = paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=12, **GREEDY)
    assert torch.equal(got, want)
    stats = cache.stats()
    assert stats["tokens_stored"] == sum(lengths) + len(lengths) * (want.shape[1] - batch["input_ids"].shape[1] - 1)
    assert stats["backends"]["prefill"] == "torch"


@pytest.mark.parametrize("block_size", [3, 8, 32])
def test_block_sizes_and_random_lengths(block_size: int):
    eager, paged = make_models("llama_gqa", seed=block_size)
    gen = torch.Generator().manual_seed(100 + block_size)
    lengths = torch.randint(1, 100, (5,), generator=gen).tolist()
    batch = left_padded_batch(lengths, gen)
    want = eager.generate(**batch, max_new_tokens=10, **GREEDY)
    got = paged.generate(**with_cache(paged, _paged_cache(paged, block_size), **batch), max_new_tokens=10, **GREEDY)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt2"])
def test_beam_search_with_num_return_sequences(arch: str):
    eager, paged = make_models(arch, seed=3)
    batch = left_padded_batch([9, 30, 2], torch.Generator().manual_seed(3))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, early_stopping=True, **GREEDY)
    want = eager.generate(**batch, **beams)
    cache = _paged_cache(paged, block_size=4)
    got = paged.generate(**with_cache(paged, cache, **batch), **beams)
    assert torch.equal(got, want)
    # reorder_cache shares blocks by reference: after the first step every beam of a prompt descends from its first
    # beam, so the prompt's full blocks are held once per prompt, not once per beam. Copies would need
    # (num_beams - 1) * (2 + 7 + 0) = 18 blocks more than this bound.
    bs, prompt_lens = 4, batch["attention_mask"].sum(1).tolist()
    full = [n // bs for n in prompt_lens]
    rows = cache.rows.num_tokens
    assert len(rows) == 3 * len(prompt_lens)
    shared_bound = sum(full) + sum(-(-(n - full[r // 3] * bs) // bs) for r, n in enumerate(rows))
    assert cache.stats()["blocks_used"] <= shared_bound


def test_num_return_sequences_sampling_matches_eager_with_same_seed():
    eager, paged = make_models("qwen2", seed=4)
    batch = left_padded_batch([12, 40], torch.Generator().manual_seed(4))
    sample = dict(do_sample=True, top_k=20, num_return_sequences=3, max_new_tokens=10, pad_token_id=PAD,
                  eos_token_id=EOS)
    torch.manual_seed(11)
    want = eager.generate(**batch, **sample)
    torch.manual_seed(11)
    got = paged.generate(**with_cache(paged, _paged_cache(paged, 8), **batch), **sample)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma", "gpt2", "mistral"])
def test_prefill_logits_match_eager(arch: str):
    eager, paged = make_models(arch, seed=5)
    batch = left_padded_batch([3, 50, 77, 1], torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = eager(**batch).logits
        got = paged(**with_cache(paged, _paged_cache(paged, 16), **batch), use_cache=True).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


def test_generate_without_paged_cache_falls_back_to_dense():
    eager, paged = make_models("llama_gqa", seed=6)
    batch = left_padded_batch([4, 21], torch.Generator().manual_seed(6))
    want = eager.generate(**batch, max_new_tokens=8, **GREEDY)
    got = paged.generate(**batch, max_new_tokens=8, **GREEDY)
    assert torch.equal(got, want)


def test_cache_reuse_and_reset():
    """A second generate call on a used cache (another batch size too) gives eager's tokens; reset frees all."""
    eager, paged = make_models("llama_gqa", seed=7)
    gen = torch.Generator().manual_seed(7)
    cache = _paged_cache(paged, 4)
    first = left_padded_batch([6, 9], gen)
    paged.generate(**with_cache(paged, cache, **first), max_new_tokens=4, **GREEDY)
    second = left_padded_batch([5, 5, 5], gen)
    want = eager.generate(**second, max_new_tokens=4, **GREEDY)
    assert torch.equal(paged.generate(**with_cache(paged, cache, **second), max_new_tokens=4, **GREEDY), want)
    cache.reset()
    assert cache.stats()["blocks_used"] == 0
    cache.pool.allocator.check_invariants()
