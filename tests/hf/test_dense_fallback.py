"""Without a PagedAttentionCache passed in, ``"hf_paged"`` gives eager's results: a plain forward runs paged on a
transient KV (``hf_paged.hf._transient``), ``generate`` gets a paged cache of its own
(``hf_paged.generate._default_cache``), and what still falls back to dense attention (a forward continuing another
cache) runs SDPA, or for logit softcapping (Gemma2; SDPA refuses it) the model's own eager attention on the same
mask."""

from __future__ import annotations

import pytest
import torch

from tiny_models import left_padded_batch, make_models


@pytest.mark.parametrize("arch", ["gemma2", "llama_gqa"])
@pytest.mark.parametrize("lengths", [[5, 9], [7]])  # left padding (a boolean mask), and none (plain causal)
def test_generate_without_a_cache_equals_eager(arch, lengths):
    eager, paged = make_models(arch, seed=3)
    batch = left_padded_batch(lengths, torch.Generator().manual_seed(len(lengths)))
    with torch.no_grad():
        want = eager(**batch).logits
        got = paged(**batch).logits
    real = batch["attention_mask"].bool()
    assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-4)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(paged.generate(**batch, **kw), eager.generate(**batch, **kw))
