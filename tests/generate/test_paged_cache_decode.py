"""Decode steps of ``generate`` on the paged cache: no read of the attention mask, one plan per forward, one backend
choice per layer shape (not per layer and step), and still eager's tokens.

On a decode step the mask handed to ``plan_step`` is swapped for a ``meta`` tensor of the same shape: it has no
data, so any read of it (a copy to the host, ``.all()``, ``.tolist()``) raises.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import EOS, PAD, left_padded_batch, make_models

import hf_paged
import hf_paged.generate._paged_cache as paged_cache_module
from hf_paged.attention._dispatch import Dispatcher
from hf_paged.hf.compat import with_cache

GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
SCENARIOS = {
    "greedy": dict(max_new_tokens=12, **GREEDY),
    "sampling-num_return_sequences": dict(do_sample=True, top_k=20, num_return_sequences=3, max_new_tokens=10,
                                          pad_token_id=PAD, eos_token_id=EOS),
    "beam-search": dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, early_stopping=True, **GREEDY),
}


@pytest.fixture
def decode_masks_unreadable(monkeypatch):
    """Hand ``plan_step`` a data-less mask on one-token steps; returns the per-call ``(q_len, mask width)`` log."""
    calls = []
    plan_step = hf_paged.PagedAttentionCache.plan_step

    def spy(self, attention_mask, batch_size, q_len, device):
        calls.append((q_len, None if attention_mask is None else attention_mask.shape[-1]))
        if q_len == 1 and attention_mask is not None:
            attention_mask = attention_mask.to("meta")
        return plan_step(self, attention_mask, batch_size, q_len, device)

    monkeypatch.setattr(hf_paged.PagedAttentionCache, "plan_step", spy)
    return calls


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2", "gpt2"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_decode_steps_do_not_read_the_mask(decode_masks_unreadable, arch: str, scenario: str):
    seed = len(arch) * 10 + len(scenario)
    eager, paged = make_models(arch, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    batch = left_padded_batch(torch.randint(2, 40, (3,), generator=gen).tolist(), gen)
    kwargs = SCENARIOS[scenario]
    torch.manual_seed(seed)
    want = eager.generate(**batch, **kwargs)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=256, block_size=4)
    torch.manual_seed(seed)
    got = paged.generate(**with_cache(paged, cache, **batch), **kwargs)
    assert torch.equal(got, want)
    decode_calls = [c for c in decode_masks_unreadable if c[0] == 1]
    assert len(decode_calls) >= want.shape[1] - batch["input_ids"].shape[1] - 1, "decode steps ran on the spy"


def test_the_new_column_of_a_decode_step_is_taken_as_real_without_reading_it():
    """What the cache assumes (docs/guides/cache.md): a one-token step's new column is ones, whatever the mask says."""
    _, paged = make_models("llama_gqa", seed=21)
    batch = left_padded_batch([3, 6], torch.Generator().manual_seed(21))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=16, block_size=4)
    with torch.no_grad():
        paged(**with_cache(paged, cache, **batch))
        zeros = torch.cat([batch["attention_mask"], torch.zeros(2, 1, dtype=torch.long)], 1)
        paged(**with_cache(paged, cache, input_ids=torch.tensor([[5], [6]]), attention_mask=zeros,
                           position_ids=torch.tensor([[3], [6]])))
    assert cache.rows.num_tokens == [4, 7]


def test_padding_in_a_multi_token_step_is_read_and_matches_eager():
    """The fallback: a forward of several tokens reads its mask, so padding inside it takes no slot."""
    eager, paged = make_models("qwen2", seed=22)
    gen = torch.Generator().manual_seed(22)
    batch = left_padded_batch([4, 7], gen)
    extra = torch.randint(3, 100, (2, 3), generator=gen)
    new_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # row 1's first new token is padding
    mask = torch.cat([batch["attention_mask"], new_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=16, block_size=4)
    with torch.no_grad():
        paged(**with_cache(paged, cache, **batch, position_ids=pos[:, :7]))
        got = paged(**with_cache(paged, cache, input_ids=extra, attention_mask=mask, position_ids=pos[:, 7:])).logits
        want = eager(input_ids=torch.cat([batch["input_ids"], extra], 1), attention_mask=mask,
                     position_ids=pos).logits[:, 7:]
    real = new_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    assert cache.rows.num_tokens == [7, 9]


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2"])  # gemma2 builds a full and a sliding mask per forward
def test_one_plan_and_one_backend_choice_per_forward(monkeypatch, arch: str):
    builds, selects, forwards = [], [], []
    build = paged_cache_module.build_metadata
    monkeypatch.setattr(paged_cache_module, "build_metadata", lambda **kw: builds.append(1) or build(**kw))
    select = Dispatcher.select
    monkeypatch.setattr(Dispatcher, "select", lambda self, call: selects.append(call) or select(self, call))
    eager, paged = make_models(arch, seed=23)
    paged.register_forward_pre_hook(lambda *args: forwards.append(1))
    batch = left_padded_batch([5, 19, 11], torch.Generator().manual_seed(23))
    want = eager.generate(**batch, max_new_tokens=10, **GREEDY)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4)
    got = paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=10, **GREEDY)
    assert torch.equal(got, want)
    assert len(builds) == len(forwards) == want.shape[1] - batch["input_ids"].shape[1]
    # One choice per distinct (phase, layer shape), made by the first layer that asks, then looked up.
    assert len(selects) == len(set(selects)) and {c.phase.value for c in selects} == {"prefill", "decode"}


@pytest.mark.cuda
@pytest.mark.parametrize("max_new_tokens", [None, 10])  # 10: fixed-shape decode plans (docs/guides/cache.md), run eagerly
def test_decode_plan_makes_no_host_sync_on_the_gpu(monkeypatch, max_new_tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager, paged = make_models("llama_gqa", seed=24)
    eager, paged = eager.cuda(), paged.cuda()
    batch = {k: v.cuda() for k, v in left_padded_batch([6, 17, 30], torch.Generator().manual_seed(24)).items()}
    plan_step, decode_steps = hf_paged.PagedAttentionCache.plan_step, []

    def strict(self, attention_mask, batch_size, q_len, device):
        if q_len != 1:
            return plan_step(self, attention_mask, batch_size, q_len, device)
        decode_steps.append(1)
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
        try:
            return plan_step(self, attention_mask, batch_size, q_len, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(hf_paged.PagedAttentionCache, "plan_step", strict)
    want = eager.generate(**batch, max_new_tokens=10, **GREEDY)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=16, device="cuda",
                                         max_new_tokens=max_new_tokens)
    got = paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=10, disable_compile=True, **GREEDY)
    assert torch.equal(got, want) and len(decode_steps) == 9
