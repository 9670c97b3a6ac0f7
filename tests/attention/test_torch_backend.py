"""The torch backend (every other backend's oracle) against a per-query float64 loop written from the math."""

from __future__ import annotations

import dataclasses
import math
import zlib
from types import SimpleNamespace

import pytest
import torch
from paged_steps import random_paged_step

from hf_paged.attention import AttentionParams, Dispatcher, Phase
from hf_paged.attention._step import PagedStep, attend_packed
from hf_paged.attention.backends._torch import TorchBackend, paged_attention_reference
from hf_paged.cache._kv_pool import KVLayout


def naive_attention(query, k_cache, v_cache, q_lens, ctx_lens, tables, params):
    bs, groups = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out, t = torch.zeros(query.shape, dtype=torch.float64), 0
    for b, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        for qi in range(q_len):
            i = ctx - q_len + qi
            for h in range(query.shape[1]):
                scores, values = [], []
                for j in range(i + 1):
                    if params.sliding_window is not None and i - j >= params.sliding_window:
                        continue
                    blk, off = tables[b][j // bs], j % bs
                    k = k_cache[blk, off, h // groups].double()
                    s = float(query[t, h].double() @ k) * params.scale
                    if params.softcap is not None:
                        s = params.softcap * math.tanh(s / params.softcap)
                    scores.append(s)
                    values.append(v_cache[blk, off, h // groups].double())
                p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[t, h] = (p[:, None] * torch.stack(values)).sum(0)
            t += 1
    return out


CASES = {
    "prefill": ([5, 1, 9], [5, 1, 9]),
    "extend": ([3, 1, 6], [10, 4, 6]),
    "decode": ([1, 1, 1, 1], [1, 7, 16, 23]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("extra", ["plain", "window", "softcap"])
def test_torch_backend_matches_naive_loop(case, heads, extra):
    q_lens, ctx_lens = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, heads, extra)).encode()))  # not hash(): PYTHONHASHSEED
    query, k_cache, v_cache, meta, tables = random_paged_step(q_lens, ctx_lens, *heads, 8, 4, gen)
    assert meta.phase == Phase(case)
    params = AttentionParams(
        scale=8**-0.5,
        sliding_window=3 if extra == "window" else None,
        softcap=2.0 if extra == "softcap" else None,
    )
    got = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                     compute_dtype=torch.float64)
    want = naive_attention(query, k_cache, v_cache, q_lens, ctx_lens, tables, params)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_kv_write_skips_padding_slots():
    gen = torch.Generator().manual_seed(0)
    query, k_cache, v_cache, meta, _ = random_paged_step([2, 1], [2, 3], 2, 2, 4, 4, gen)
    backend = Dispatcher().writer(k_cache)
    before = k_cache.clone()
    key = torch.randn(3, 2, 4, generator=gen)
    object.__setattr__(meta, "has_padding_slots", True)
    meta.slot_mapping[1] = -1
    backend.write_kv(key, key, k_cache, v_cache, meta)
    flat = k_cache.view(-1, 2, 4)
    for t in (0, 2):
        assert torch.equal(flat[meta.slot_mapping[t]], key[t])
    changed = (k_cache != before).any(-1).any(-1).sum()
    assert int(changed) == 2


def test_metadata_moves_to_another_device_once_per_step():
    _, _, _, meta, _ = random_paged_step([2, 1], [5, 3], 2, 1, 4, 4, torch.Generator().manual_seed(6))
    step = PagedStep(meta, None, None)
    moved = step.on(torch.device("meta"))
    assert moved.slot_mapping.device.type == "meta" and moved.block_tables.shape == meta.block_tables.shape
    assert step.on(torch.device("meta")) is moved, "a second layer on that device reuses the copy"
    assert step.on(torch.device("cpu")) is meta and moved.phase == meta.phase and moved.num_tokens == meta.num_tokens


def test_layers_share_one_plan_per_step_and_leave_the_metadata_as_built(monkeypatch):
    """Each layer's forward gets the plan its backend made once for the step; the metadata holds no state of its own
    (frozen, no per-step dict), so a forward changes none of its fields, and the output is the reference's."""
    gen = torch.Generator().manual_seed(4)
    query, k_cache, v_cache, meta, _ = random_paged_step([3, 1], [6, 4], 4, 2, 8, 4, gen)
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    plans, seen, forward = [], [], TorchBackend.forward
    monkeypatch.setattr(TorchBackend, "plan", lambda self, m: plans.append(m) or object())
    monkeypatch.setattr(TorchBackend, "forward", lambda self, x, plan: seen.append(plan) or forward(self, x, plan))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8)
    pool = SimpleNamespace(layout=layout, kv_caches=[(k_cache, v_cache)] * 2, kv_scales=None)
    step = PagedStep(meta, pool, Dispatcher("torch"))
    key = torch.randn(meta.num_tokens, 2, 8, generator=gen)
    outs = [attend_packed(step, layer, query, key, key, None, None, None) for layer in (0, 1)]
    assert plans == [meta] and len(seen) == 2 and seen[0] is seen[1]
    assert all(getattr(meta, name) is value for name, value in fields.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.num_tokens = 0
    want = paged_attention_reference(query, k_cache, v_cache, meta, AttentionParams(scale=8**-0.5))
    torch.testing.assert_close(outs[1], want)
