"""A forward with no paged cache that starts from nothing runs paged on a transient KV (``hf_paged.hf._transient``):
eager's logits, every layer through the paged attention, no dense fallback; what continues a cache that is not
paged stays dense."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_paged.hf import _attention
from hf_paged.hf._transient import TransientKV, fresh_step
from hf_paged.hf.compat import with_cache
from tiny_models import left_padded_batch, make_config, make_models


@pytest.fixture
def paths(monkeypatch):
    """Counts of the layers served paged on a transient KV, and of dense fallbacks."""
    seen = {"paged": 0, "dense": 0}
    attend, dense = _attention.attend, _attention._dense_fallback

    def counting_attend(step, *args):
        seen["paged"] += isinstance(step.pool, TransientKV)
        return attend(step, *args)

    def counting_dense(*args, **kwargs):
        seen["dense"] += 1
        return dense(*args, **kwargs)

    monkeypatch.setattr(_attention, "attend", counting_attend)
    monkeypatch.setattr(_attention, "_dense_fallback", counting_dense)
    return seen


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2", "mistral"])
@pytest.mark.parametrize("lengths", [[6, 19], [11], [3, 17, 9]])
def test_a_plain_forward_runs_paged_with_eager_logits(arch, lengths, paths):
    """Left-padded (a padding mask), unpadded with no mask (lm-eval's scoring), and a bare ``input_ids`` call."""
    eager, paged = make_models(arch, seed=len(lengths))
    batch = left_padded_batch(lengths, torch.Generator().manual_seed(sum(lengths)))
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want, got = eager(**batch).logits, paged(**batch).logits
        want_bare, got_bare = eager(batch["input_ids"]).logits, paged(batch["input_ids"]).logits
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_bare, want_bare, rtol=1e-4, atol=1e-5)
    assert paths == {"paged": 2 * paged.config.num_hidden_layers, "dense": 0}


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2"])  # gemma2: softcapping, the model's own eager attention
def test_a_forward_that_continues_a_dense_cache_stays_dense(arch, paths):
    eager, paged = make_models(arch, seed=5)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        caches = [DynamicCache(config=m.config) for m in (eager, paged)]
        for model, cache in zip((eager, paged), caches):
            model(ids[:, :6], use_cache=True, **with_cache(model, cache))
        paths["paged"] = 0
        want, got = (model(ids[:, 6:], use_cache=True, **with_cache(model, cache)).logits
                     for model, cache in zip((eager, paged), caches))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert paths["paged"] == 0 and paths["dense"] == paged.config.num_hidden_layers


def test_a_forward_that_records_gradients_stays_dense(paths):
    """Autograd on (a training step, a gradient check): transformers' SDPA path, with eager's logits and gradients."""
    eager, paged = make_models("llama_gqa", seed=6)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(6))
    want, got = eager(ids).logits, paged(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    want.square().mean().backward()
    got.square().mean().backward()
    torch.testing.assert_close(paged.model.layers[0].self_attn.q_proj.weight.grad,
                               eager.model.layers[0].self_attn.q_proj.weight.grad, rtol=1e-3, atol=1e-6)
    assert paths == {"paged": 0, "dense": paged.config.num_hidden_layers}


def test_the_transient_step_gives_each_row_consecutive_blocks():
    """Rows of 5, 0 and 18 real tokens in 16-token blocks: blocks [0], [], [1, 2]; slots in row order."""
    mask = torch.zeros(3, 18, dtype=torch.bool)
    mask[0, -5:], mask[2, :] = True, True
    step = fresh_step(make_config("llama_gqa"), mask, 3, 18, torch.device("cpu"))
    meta, bs = step.metadata, step.pool.block_size
    assert bs == 16 and step.pool.num_blocks == 3
    assert meta.seq_lens_k.tolist() == [5, 0, 18] and meta.block_tables[0, 0] == 0
    assert meta.block_tables[2].tolist() == [1, 2]
    assert meta.slot_mapping.tolist() == [*range(5), *range(16, 34)]
    assert meta.token_index.tolist() == [*range(13, 18), *range(36, 54)]
    key = torch.zeros(3, 2, 18, 32)
    assert step.pool.claim(1, key) and step.pool.kv_caches[0] is None  # made per layer, on first use
    assert step.pool.kv_caches[1][0].shape == (3, 16, 2, 32)
    assert not step.pool.claim(0, torch.zeros(3, 4, 18, 32))  # another head count than this forward's layers
