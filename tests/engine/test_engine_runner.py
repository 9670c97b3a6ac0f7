"""The step plan against a token-by-token reference, and a padded decode step against the unpadded one."""

from __future__ import annotations

import random

import torch

import hf_paged
from engine_helpers import models
from fake_kv import make_block_manager
from hf_paged.engine.runner import plan_step
from hf_paged.engine.sampling_params import SamplingParams
from hf_paged.engine.sequence import Sequence


def naive_plan(seqs, counts, block_size):
    """Token by token, the obvious way."""
    ids, pos, slots = [], [], []
    for seq, n in zip(seqs, counts):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
    return ids, pos, slots


def test_plan_matches_a_token_by_token_layout():
    rng = random.Random(0)
    bs = 4
    bm, kv = make_block_manager(num_blocks=200, block_size=bs, max_rows=16)
    seqs, counts = [], []
    for i in range(12):
        seq = Sequence(str(i), [rng.randrange(50) for _ in range(rng.randint(1, 30))], SamplingParams(max_new_tokens=2),
                       (i, 0), 0)
        bm.admit(seq, [])
        done = rng.randint(0, seq.num_tokens - 1)
        bm.reserve(seq, done)
        bm.commit([seq], [done])
        n = rng.randint(1, seq.num_tokens - done)
        bm.reserve(seq, n)
        seqs.append(seq)
        counts.append(n)
    sample = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, counts)]
    plan = plan_step(seqs, counts, sample, bm.tables, bs)
    ids, pos, slots = naive_plan(seqs, counts, bs)
    assert plan.input_ids.tolist() == ids and plan.position_ids.tolist() == pos
    assert plan.slot_mapping.tolist() == slots
    assert plan.q_lens.tolist() == counts
    assert plan.seq_lens_k.tolist() == [s.num_computed_tokens + n for s, n in zip(seqs, counts)]
    ends = torch.tensor(counts).cumsum(0) - 1
    assert plan.logits_indices.tolist() == ends[torch.tensor(sample)].tolist()
    for row, seq in zip(plan.block_tables.tolist(), seqs):
        assert row[: len(seq.block_table)] == seq.block_table


def test_a_decode_step_padded_to_a_graph_size_gives_the_same_logits():
    engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=32, block_size=4, max_batch_tokens=64)
    for prompt in ([5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]):
        engine.add_request(prompt)
    engine.step()  # prefill: every sequence now decodes one token per step
    batch = engine.scheduler.schedule()
    assert all(n == 1 for n in batch.num_tokens)
    plain = plan_step(batch.seqs, batch.num_tokens, batch.sample, engine.block_manager.tables, 4)
    padded = plan_step(batch.seqs, batch.num_tokens, batch.sample, engine.block_manager.tables, 4, pad_decode_to=8)
    assert padded.num_tokens == 8 and padded.slot_mapping[3:].eq(-1).all()
    k_before = [k.clone() for k, _ in engine.cache.pool.kv_caches]
    want = engine.runner.forward(plain)
    got = engine.runner.forward(padded)  # rewrites the same slots with the same values; padding writes nothing
    assert torch.allclose(got, want, atol=1e-5)
    for (k, _), before in zip(engine.cache.pool.kv_caches, k_before):
        changed = (k != before).any(-1).any(-1).flatten(0, 1).nonzero().flatten()
        assert set(changed.tolist()) <= set(plain.slot_mapping.tolist())
