"""The step plan against a token-by-token reference (its layout, and the attention metadata read from it against
``build_metadata`` of the reference, on every step of mixed prefill/decode runs), and a padded decode step against
the unpadded one."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import hf_paged
from engine_helpers import greedy_config, models, random_prompts
from fake_kv import make_block_manager
from hf_paged.attention._metadata import Phase, build_metadata
from hf_paged.runner import _model_runner as model_runner
from hf_paged.runner._step_plan import StepPlan, logit_rows, plan_step, step_metadata
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sequence import Sequence


def naive_plan(seqs, counts, block_size):
    """Token by token, the obvious way."""
    ids, pos, slots = [], [], []
    for seq, n in zip(seqs, counts):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
    return ids, pos, slots


def padded_rows(keep: list[int]) -> list[int]:
    """The logits indices a plan holds: ``keep``, then its last entry again up to the next power of two (at most
    256; beyond, the next multiple of 256)."""
    size = 1 << (len(keep) - 1).bit_length() if 0 < len(keep) <= 256 else -(-len(keep) // 256) * 256
    return keep + keep[-1:] * (size - len(keep))


def test_logit_rows_pads_to_few_sizes():
    assert [logit_rows(n) for n in (0, 1, 2, 3, 5, 8, 9, 31, 33, 129, 256, 257, 511, 513)] == [
        0, 1, 2, 4, 8, 8, 16, 32, 64, 256, 256, 512, 512, 768]
    sizes = {logit_rows(n) for n in range(1, 1025)}
    assert len(sizes) == 12  # 1 .. 256 (nine), 512, 768, 1024
    assert all(n <= logit_rows(n) <= 2 * n and logit_rows(n) - n < 256 for n in range(1, 4097))


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
    assert plan.logits_indices.tolist() == padded_rows(ends[torch.tensor(sample)].tolist())
    assert plan.num_sampled == sum(sample)
    for row, seq in zip(plan.block_tables.tolist(), seqs):
        assert row[: len(seq.block_table)] == seq.block_table


def _with_padding_rows(plan: StepPlan, b: int) -> StepPlan:
    """A decode step's ``plan`` padded to ``b`` sequences as a decode graph pads its steps on the device
    (``runner/_decode_graphs.py``): token 0 at position 0, slot -1 (nothing written), context 1, a zero table row."""
    seg, pad = plan.segments(), b - plan.num_seqs
    assert seg["token_sources"] is None and plan.padded_rows == 0

    def padded(name: str, value: int) -> torch.Tensor:
        return torch.cat([seg[name], torch.full((pad,), value, dtype=torch.int32)])

    q, ctx = padded("q_lens", 1), padded("seq_lens_k", 1)
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.int32), x.cumsum(0, dtype=torch.int32)]) for x in (q, ctx))
    tables = torch.cat([seg["block_tables"], torch.zeros(pad, plan.width, dtype=torch.int32)])
    layout = torch.cat([padded("input_ids", 0), padded("position_ids", 0), padded("slot_mapping", -1),
                        seg["logits_indices"], q, ctx, cu_q, cu_k, tables.flatten()])
    return dataclasses.replace(plan, layout=layout, num_seqs=b, num_tokens=b, has_padding=True)


def test_a_decode_step_padded_to_a_graph_size_gives_the_same_logits():
    engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=32, block_size=4, max_batch_tokens=64)
    for prompt in ([5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]):
        engine.add_request(prompt)
    engine.step()  # prefill: every sequence now decodes one token per step
    batch = engine.scheduler.schedule()
    assert all(n == 1 for n in batch.num_tokens)
    plain = plan_step(batch.seqs, batch.num_tokens, batch.sample, engine.block_manager.tables, 4)
    padded = _with_padding_rows(plain, 8)
    assert padded.num_tokens == 8 and padded.slot_mapping[3:].eq(-1).all()
    assert padded.input_ids[:3].tolist() == plain.input_ids.tolist() and padded.seq_lens_k[3:].eq(1).all()
    k_before = [k.clone() for k, _ in engine.runner.pool.kv_caches]
    want = engine.runner.forward(plain)
    got = engine.runner.forward(padded)  # rewrites the same slots with the same values; padding writes nothing
    assert torch.allclose(got, want, atol=1e-5)
    for (k, _), before in zip(engine.runner.pool.kv_caches, k_before):
        changed = (k != before).any(-1).any(-1).flatten(0, 1).nonzero().flatten()
        assert set(changed.tolist()) <= set(plain.slot_mapping.tolist())


def _reference_metadata(seqs, counts, sample, tables, block_size, runner):
    """The metadata of the step as the engine built it before the plan's layout: token by token, then
    ``build_metadata``; and the reference in-flight sources and sampled rows."""
    ids, pos, slots = naive_plan(seqs, counts, block_size)
    ctx = [s.num_computed_tokens + n for s, n in zip(seqs, counts)]
    width = -(-max(ctx) // block_size)
    meta = build_metadata(
        q_lens=torch.tensor(counts), seq_lens_k=torch.tensor(ctx),
        block_tables=tables.table[torch.tensor([s.row for s in seqs]), :width], slot_mapping=torch.tensor(slots),
        token_index=None, grid=(1, len(ids)), block_size=block_size, device=torch.device("cpu"))
    ends = torch.tensor(counts).cumsum(0) - 1
    sources = [-1] * len(ids)
    for end, s, smp in zip(ends.tolist(), seqs, sample):
        if smp and s.pending_row >= 0:
            sources[end] = s.pending_row
    return meta, ids, pos, sources if max(sources) >= 0 else None, ends[torch.tensor(sample)].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_metadata_read_from_the_plan_equals_build_metadata_of_a_token_by_token_reference(monkeypatch,
                                                                                             async_scheduling):
    engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=64, block_size=4, max_batch_tokens=24,
                             max_num_seqs=6, async_scheduling=async_scheduling)
    checked = []

    def checked_plan(seqs, counts, sample, tables, block_size, extra_rows=None, pad_logits=False):
        assert extra_rows is None and not pad_logits  # (no prompt logprobs asked; the CPU pads no logits rows)
        plan = plan_step(seqs, counts, sample, tables, block_size)
        want, ids, pos, sources, keep = _reference_metadata(seqs, counts, sample, tables, block_size, engine.runner)
        seg = plan.segments()
        got = step_metadata(plan, seg, seg["slot_mapping"].long(), block_size)
        for name in ("num_seqs", "num_tokens", "max_seqlen_q", "max_seqlen_k", "block_size", "phase", "grid",
                     "has_padding_slots"):
            assert getattr(got, name) == getattr(want, name), name
        for name in ("cu_seqlens_q", "cu_seqlens_k", "seq_lens_k", "block_tables", "slot_mapping"):
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert seg["input_ids"].tolist() == ids and seg["position_ids"].tolist() == pos
        assert seg["logits_indices"].tolist() == keep and plan.num_sampled == len(keep)
        assert (None if seg["token_sources"] is None else seg["token_sources"].tolist()) == sources
        ones = next((i for i, n in enumerate(counts) if n != 1), len(counts))
        assert got.single_token_prefix == (0 if want.phase is Phase.DECODE else ones)
        checked.append((want.phase, sources is not None, got.single_token_prefix))
        return plan

    monkeypatch.setattr(model_runner, "plan_step", checked_plan)
    prompts = random_prompts(9, 1, 30, seed=3)
    engine.generate(prompts, greedy_config(6))
    phases = {phase.value for phase, _, _ in checked}
    assert {"prefill", "extend", "decode"} <= phases, phases
    assert any(pending for _, pending, _ in checked) == async_scheduling
    assert any(phase is Phase.EXTEND and ones for phase, _, ones in checked)  # decode rows ahead of a chunk
