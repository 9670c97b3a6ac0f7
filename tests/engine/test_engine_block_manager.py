"""Property tests of the block manager: random admissions, growth, forks and frees keep every invariant, and every
computed token reads back its own KV (prefix-cache hits and copy-on-write included)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from fake_kv import check_table_rows, make_block_manager
from hf_paged.engine.sampling_params import SamplingParams
from hf_paged.engine.sequence import Sequence

PARAMS = SamplingParams(max_new_tokens=4)


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 3, 4]),
    ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "fork", "free"]), st.integers(0, 10**6)), max_size=60),
)
def test_random_operations_keep_invariants(num_blocks, block_size, ops):
    bm, kv = make_block_manager(num_blocks, block_size, max_rows=64)
    live: list[Sequence] = []
    for n, (op, r) in enumerate(ops):
        if op == "add":  # small vocabulary and shared starts so prefixes repeat
            prompt = [r % 3] * (r % 5) + [(r >> 3) % 4 for _ in range(1 + r % 13)]
            seq = Sequence(str(n), prompt, PARAMS, (n, 0), seed=0)
            hits = bm.find_prefix(seq)
            todo = min(seq.num_tokens - len(hits) * block_size, 1 + r % 7)
            if bm.blocks_needed(seq, todo, hits) <= bm.num_free_blocks:
                bm.admit(seq, hits)
                live.append(seq)
                _compute(bm, kv, seq, todo)
        elif op == "grow" and live:
            seq = live[r % len(live)]
            if seq.num_uncomputed == 0:
                seq.token_ids.append(r % 4)
            todo = bm.max_tokens_fitting(seq, min(seq.num_uncomputed, 1 + r % 5))
            if todo:
                _compute(bm, kv, seq, todo)
        elif op == "fork" and live:
            parent = live[r % len(live)]
            if parent.num_computed_tokens:
                child = Sequence(f"{n}c", parent.token_ids[: parent.num_computed_tokens + 1], PARAMS, (n, 1), 0)
                bm.fork(parent, child, parent.num_computed_tokens)
                live.append(child)
        elif op == "free" and live:
            bm.free(live.pop(r % len(live)))
        bm.check_invariants(live)
        check_table_rows(bm, live)
        for seq in live:
            kv.check(seq)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks


def _compute(bm, kv, seq, n):
    bm.reserve(seq, n)
    kv.write(seq, n)
    bm.commit([seq], [n])


def test_freed_blocks_stay_findable_until_reallocated_least_recently_used_first():
    bm, kv = make_block_manager(num_blocks=4, block_size=2, max_rows=8)
    a = Sequence("a", [1, 2, 3, 4, 5], PARAMS, (0, 0), 0)
    bm.admit(a, [])
    _compute(bm, kv, a, 5)
    a_full_blocks = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    again = Sequence("b", [1, 2, 3, 4, 9], PARAMS, (1, 0), 0)
    hits = bm.find_prefix(again)
    assert hits == a_full_blocks
    bm.admit(again, hits)  # takes the two free cached blocks back
    assert again.num_computed_tokens == 4 and bm.num_free_blocks == 2
    _compute(bm, kv, again, 1)
    kv.check(again)
    bm.free(again)
    other = Sequence("c", [7] * 8, PARAMS, (2, 0), 0)
    bm.admit(other, [])
    _compute(bm, kv, other, 8)  # needs all 4 blocks: evicts every cached prefix
    assert bm.find_prefix(Sequence("d", [1, 2, 3, 4, 5], PARAMS, (3, 0), 0)) == []
    bm.check_invariants([other])

