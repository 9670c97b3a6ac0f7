"""The torch backend (every other backend's oracle) against a per-query float64 loop written from the math."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from paged_steps import random_paged_step

from hf_paged.attention import AttentionParams, Dispatcher, Phase
from hf_paged.attention.backends._torch import paged_attention_reference


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
    moved = meta.on(torch.device("meta"))
    assert moved.slot_mapping.device.type == "meta" and moved.block_tables.shape == meta.block_tables.shape
    assert meta.on("meta") is moved, "a second layer on that device reuses the copy"
    assert meta.on("cpu") is meta and moved.phase == meta.phase and moved.num_tokens == meta.num_tokens
