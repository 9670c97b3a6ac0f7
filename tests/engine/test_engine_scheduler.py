"""Property tests of the scheduler with random arrivals, aborts, lengths, block budgets and token budgets.

No model: a "forward" writes each scheduled token into its slot of a fake KV, and the "sampled" token is a pure
function of all tokens so far, so a request preempted and recomputed must end with exactly the tokens it would have
produced uninterrupted.
"""

from __future__ import annotations

import zlib
from array import array

from hypothesis import given, settings, strategies as st

from fake_kv import check_table_rows, make_block_manager
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._scheduler import Scheduler
from hf_paged.engine._sequence import Sequence, SequenceStatus

VOCAB = 5


def next_token(tokens: list[int]) -> int:
    return zlib.crc32(array("q", tokens).tobytes()) % VOCAB


def expected_output(prompt: list[int], max_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


request = st.tuples(
    st.integers(0, 12),  # arrival step
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),  # prompt
    st.integers(1, 12),  # max_new_tokens
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
)


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(3, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_batch_tokens=st.integers(1, 48),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
    requests=st.lists(request, min_size=1, max_size=12),
)
def test_random_workloads(num_blocks, block_size, max_batch_tokens, max_num_seqs, prefix_caching, requests):
    bm, kv = make_block_manager(num_blocks, block_size, max_num_seqs, prefix_caching)
    sched = Scheduler(bm, max_batch_tokens, max_num_seqs)
    requests = sorted(requests, key=lambda r: r[0])  # ids (and arrival order) follow the order of arrival
    seqs = [Sequence(str(i), prompt, SamplingParams(max_new_tokens=new), (i, 0), seed=0)
            for i, (_, prompt, new, _) in enumerate(requests)]
    first_run: list[Sequence] = []
    step = 0
    while step < 2000:
        for i, (arrive, _, _, abort_at) in enumerate(requests):
            if arrive == step:
                sched.add(seqs[i])
            if abort_at == step and arrive <= step and not seqs[i].is_finished:
                assert sched.abort(str(i)) == [seqs[i]]
        if step > max(r[0] for r in requests) and not sched.has_unfinished():
            break
        batch = sched.schedule()
        sched.failed.clear()
        _check_batch(batch, max_batch_tokens, block_size)
        first_run += [s for s in batch.seqs if s not in first_run]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            kv.write(seq, n)
        sched.block_manager.commit(batch.seqs, batch.num_tokens)
        for seq, sample in zip(batch.seqs, batch.sample):
            if sample:
                seq.token_ids.append(next_token(seq.token_ids))
                if seq.num_generated >= seq.params.max_new_tokens:
                    sched.finish(seq, "length")
        sched.check_invariants()
        check_table_rows(bm, sched.running)
        for seq in sched.running:
            kv.check(seq)
        step += 1
    assert not sched.has_unfinished(), "the scheduler stopped making progress"
    assert bm.num_free_blocks == num_blocks
    assert [s.arrival for s in first_run] == sorted(s.arrival for s in first_run), "admission is not FIFO"
    for seq, (_, prompt, new, _) in zip(seqs, requests):
        assert seq.is_finished
        if seq.finish_reason == "length":
            assert seq.output_token_ids == expected_output(prompt, new)
        elif seq.finish_reason == "error":
            assert seq.num_tokens > num_blocks * block_size  # it really could not fit
            assert seq.output_token_ids == expected_output(prompt, new)[: seq.num_generated]
        else:
            assert seq.finish_reason == "abort"
            assert seq.output_token_ids == expected_output(prompt, new)[: seq.num_generated]


def _check_batch(batch, max_batch_tokens, block_size):
    assert sum(batch.num_tokens) <= max_batch_tokens
    assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
    for seq, n, sample in zip(batch.seqs, batch.num_tokens, batch.sample):
        assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_uncomputed
        assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
        assert sample == (seq.num_computed_tokens + n == seq.num_tokens)
