"""A PagedAttentionCache used again: by a second ``generate`` call, by direct forwards, and after running out of
blocks mid-decode. The oracle is eager ``generate`` on the second input and a new paged cache given it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import EOS, PAD, left_padded_batch, make_models

import hf_paged
from hf_paged.hf.compat import with_cache

GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


def _cache(model, num_blocks: int = 64, block_size: int = 4) -> hf_paged.PagedAttentionCache:
    return hf_paged.PagedAttentionCache(model.config, num_blocks=num_blocks, block_size=block_size)


def _second_input(kind: str, first: dict, first_out: torch.Tensor, gen: torch.Generator) -> dict:
    """The second call's input; ``first`` had rows of 6 and 9 tokens and ran 5 new tokens (12 columns held)."""
    if kind == "same prompt":
        return first
    if kind.startswith("continue"):  # the first call's output, plus tokens of a next turn
        extra = torch.randint(3, 100, (2, 3 if kind.endswith("turn") else 0), generator=gen)
        ids = torch.cat([first_out, extra], 1)
        mask = torch.cat([first["attention_mask"], torch.ones(2, ids.shape[1] - 9, dtype=torch.long)], 1)
        return {"input_ids": ids, "attention_mask": mask}
    lengths = {"other prompt, same shape": [6, 9], "other prompt, 12 columns": [12, 3],
               "other prompt, longer": [20, 14], "other prompt, shorter": [2, 4], "three rows": [5, 8, 5]}[kind]
    return left_padded_batch(lengths, gen)


@pytest.mark.parametrize("kind", ["same prompt", "continue", "continue, next turn", "other prompt, same shape",
                                  "other prompt, 12 columns", "other prompt, longer", "other prompt, shorter",
                                  "three rows"])
def test_a_second_generate_gives_the_fresh_run_tokens(kind: str):
    eager, paged = make_models("llama_gqa", seed=31)
    gen = torch.Generator().manual_seed(len(kind))
    first = left_padded_batch([6, 9], gen)
    cache = _cache(paged)
    first_out = paged.generate(**with_cache(paged, cache, **first), max_new_tokens=4, min_new_tokens=4, **GREEDY)
    assert cache.get_seq_length() == 12
    second = _second_input(kind, first, first_out, gen)
    want = eager.generate(**second, max_new_tokens=5, **GREEDY)
    fresh = _cache(paged)
    assert torch.equal(paged.generate(**with_cache(paged, fresh, **second), max_new_tokens=5, **GREEDY), want)
    got = paged.generate(**with_cache(paged, cache, **second), max_new_tokens=5, **GREEDY)
    assert torch.equal(got, want)
    assert cache.stats()["blocks_used"] == fresh.stats()["blocks_used"], "the first call's blocks were freed"
    cache.pool.allocator.check_invariants()


def test_generate_marks_the_cache_at_the_start_of_each_call(monkeypatch):
    """The sign the cache relies on to empty itself: if a transformers release stops giving it, this fails first."""
    _, paged = make_models("llama_gqa", seed=34)
    batch = left_padded_batch([4, 6], torch.Generator().manual_seed(34))
    cache, resets = _cache(paged), []
    reset = hf_paged.PagedAttentionCache.reset
    monkeypatch.setattr(hf_paged.PagedAttentionCache, "reset", lambda self: resets.append(1) or reset(self))
    for _ in range(2):
        paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=2, **GREEDY)
    assert len(resets) == 2


def test_out_of_blocks_mid_decode_says_how_to_free_and_the_next_call_frees():
    eager, paged = make_models("llama_gqa", seed=32)
    batch = left_padded_batch([7, 8], torch.Generator().manual_seed(32))
    cache = _cache(paged, num_blocks=6, block_size=4)  # the prompts take 4 blocks, decoding runs out
    with pytest.raises(hf_paged.OutOfBlocksError, match=r"cache\.reset\(\) frees them") as err:
        paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=12, min_new_tokens=12, **GREEDY)
    assert err.value.needed > err.value.free
    s = cache.stats()
    assert s["blocks_used"] == 6 and s["blocks_used"] + s["blocks_free"] == s["num_blocks"], "failed mid-decode"
    cache.pool.allocator.check_invariants()
    want = eager.generate(**batch, max_new_tokens=3, **GREEDY)
    assert torch.equal(paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=3, **GREEDY), want)
    cache.reset()
    s = cache.stats()
    assert s["blocks_used"] == 0 and s["blocks_free"] == s["num_blocks"] == 6
    cache.pool.allocator.check_invariants()


def test_direct_forwards_continue_restart_or_refuse():
    eager, paged = make_models("qwen3", seed=33)
    gen = torch.Generator().manual_seed(33)
    cache = _cache(paged)
    first, second = left_padded_batch([5, 8], gen), left_padded_batch([3, 9, 4], gen)
    with torch.no_grad():
        paged(**with_cache(paged, cache, **first))
        got = paged(**with_cache(paged, cache, **second)).logits  # the whole input: starts afresh
        want = eager(**second).logits
        real = second["attention_mask"].bool()
        torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
        assert cache.stats()["tokens_stored"] == 16
        nxt = torch.randint(3, 100, (3, 2), generator=gen)
        short = torch.ones(3, 5, dtype=torch.long)  # says the cache holds 3 columns, it holds 9
        with pytest.raises(ValueError, match=r"holds 3 sequences of 9 columns.*cache\.reset\(\)"):
            paged(**with_cache(paged, cache, input_ids=nxt, attention_mask=short))
        assert cache.stats()["tokens_stored"] == 16, "a refused forward changes nothing"
