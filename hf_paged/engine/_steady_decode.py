"""``SteadyDecode``: decode steps that repeat over the same sequences, kept as arrays between steps.

Most steps of a busy engine repeat the step before: every running sequence computes its newest token and samples
the next, nothing is admitted, nothing finishes. The general step then spends most of its host time in
per-sequence Python that finds what the arrays already say: the scheduler checks every sequence for room, the
layout reads every counter, the hand-over and the commit each walk every sequence.

While the scheduler's running list stays the same (its ``version``), ``SteadyDecode`` keeps the step's columns
(positions, block-table rows, length limits, EOS ids) as numpy arrays and does each of those in a few array
operations. What is left per sequence is one loop that writes the new token and the placeholder (or, without
asynchronous scheduling, appends the token) and counts the computed token.

Anything out of the ordinary falls back to the general step, which is always correct: a waiting request that could
be admitted, a sequence at its length limit, one that needs a block the free list cannot give, a sampled EOS, stop
strings, a repetition penalty, ``num_return_sequences`` copies still to fork. Any change to the running
list (a finish, an abort from another thread, a preemption, an admission) ends the run; the next step that
qualifies starts a new one.
"""

from __future__ import annotations

import operator

import numpy as np

from hf_paged.runner._step_plan import DecodeColumns
from hf_paged.engine._sampler import SamplingBatch, split_logprob_row
from hf_paged.engine._scheduler import ScheduledBatch, Scheduler
from hf_paged.engine._sequence import PLACEHOLDER, Sequence

_COMPUTED, _ROW, _STOP_AT, _PARAMS, _PENDING_ROW, _CHILDREN = (
    operator.attrgetter(a) for a in ("num_computed_tokens", "row", "stop_at", "params", "pending_row",
                                     "pending_children"))


class SteadyDecode:
    """The running sequences of a decode step just committed, as arrays, while the running list stays the same.

    ``pending``: their newest tokens are in flight (asynchronous scheduling; sequence ``i`` waits on row ``i`` of
    the step's tokens); otherwise the host has them (``last_ids``).
    """

    def __init__(self, seqs: list[Sequence], version: int, block_size: int, max_model_len: int, pending: bool):
        n = len(seqs)
        self.seqs, self.version, self.block_size, self.pending = seqs, version, block_size, pending
        self.batch = ScheduledBatch(seqs, [1] * n, [True] * n)
        self.computed = np.fromiter(map(_COMPUTED, seqs), np.int32, n)
        self.rows = np.fromiter(map(_ROW, seqs), np.int32, n)
        # the length each sequence stops at (its own limit, or the model's)
        self.limit = np.minimum(np.fromiter(map(_STOP_AT, seqs), np.int64, n), max_model_len)
        params = set(map(_PARAMS, seqs))
        # every new token needs only an EOS and a length check on the host (and its logprob kept, where asked)
        self.plain = not any(p.stop_strings for p in params) and not any(map(_CHILDREN, seqs))
        self.logprob_rows = [i for i, p in enumerate(map(_PARAMS, seqs)) if p.logprobs]
        # each row's EOS ids, padded with -1 (ids beyond int64 are beyond any vocabulary: never sampled)
        eos = {p: [e for e in p.eos_token_ids if e < 2**63] for p in params}
        width = max(map(len, eos.values()))
        self.eos = None
        if width:
            self.eos = np.full((n, width), -1, np.int64)
            for i, p in enumerate(map(_PARAMS, seqs)):
                self.eos[i, : len(eos[p])] = eos[p]
        # every row plain greedy without logprobs: the sampler's settings are the same every step
        self.sampling = (SamplingBatch(n, False) if all(p.is_plain_greedy and not p.logprobs for p in params)
                         else None)
        self.last_ids = None if pending else np.fromiter((s.token_ids[-1] for s in seqs), np.int32, n)
        self._sources = np.arange(n, dtype=np.int32) if pending else np.full(n, -1, np.int32)
        self._in_flight = np.full(n, PLACEHOLDER, np.int32)  # the ids of in-flight tokens, as the sequences hold them

    @classmethod
    def after(cls, batch: ScheduledBatch, scheduler: Scheduler, block_size: int, max_model_len: int,
              pending: bool) -> SteadyDecode | None:
        """A run over ``batch`` if it was a plain decode step of every running sequence (one token each, all
        sampled) that the next step may repeat; else None."""
        seqs = batch.seqs
        if not seqs or batch.total_tokens != len(seqs) or not all(batch.sample) or seqs != scheduler.running:
            return None
        if any(p.reads_own_tokens for p in set(map(_PARAMS, seqs))):
            return None  # a penalty or a grammar reads the tokens before each step: the general step does that
        if pending != (min(map(_PENDING_ROW, seqs)) >= 0):
            return None
        return cls(seqs, scheduler.version, block_size, max_model_len, pending)

    def schedule(self, scheduler: Scheduler) -> ScheduledBatch | None:
        """The step before again, with a new block for each sequence whose last block is full; None (having changed
        nothing) when the general scheduler must decide."""
        if scheduler.version != self.version:
            return None
        n, c = len(self.seqs), self.computed
        if n > scheduler.max_batch_tokens:
            return None
        bm = scheduler.block_manager
        if (scheduler.waiting and n < scheduler.max_batch_tokens and n < scheduler.max_num_seqs
                and bm.tables.num_free_rows):
            return None  # a waiting request may be admitted
        # A sequence whose next token reaches its length limit ends when the token arrives: the general step
        # handles that (with the token in flight, ``c + 1`` is its length then; else ``c + 2``).
        if (c + (1 if self.pending else 2) >= self.limit).any():
            return None
        # Only a sequence whose last block is full needs room (a block of its own): the run began after a general
        # step, which copied any shared tail block, and sharing a block takes a fork or an admission, both of
        # which end the run.
        seqs, bs = self.seqs, self.block_size
        full = [seqs[i] for i in np.flatnonzero(c % bs == 0).tolist()]
        full = [seq for seq in full if len(seq.block_table) * bs <= seq.num_computed_tokens]  # (none reserved yet)
        if full and not bm.add_last_blocks(full):
            return None  # the general scheduler preempts
        return self.batch

    def columns(self) -> DecodeColumns:
        """The step's decode columns: every token is the sequence's newest, in flight (``pending``) or known."""
        return DecodeColumns(self._in_flight if self.pending else self.last_ids, self.computed, self._sources, self.rows)

    def take_in(self, tokens: np.ndarray) -> bool:
        """Whether the step's ``tokens`` (row ``i``: sequence ``i``'s) end nothing: no EOS, no length limit
        reached (:meth:`schedule` checked the lengths), and the sequences need no check beyond those."""
        if not self.plain:
            return False
        return self.eos is None or not (tokens[:, None] == self.eos).any()

    def commit(self, tokens: list[int], register, logprobs: list[float] | None = None) -> None:
        """Write the step's tokens (``pending``: in place of each placeholder, then a new placeholder for the
        token the step just launched samples; else appended) and count the computed token; ``register``: the
        prefix cache's ``register_full_blocks``, or None; ``logprobs``: the step's, kept by the rows that ask."""
        seqs = self.seqs
        for i in self.logprob_rows:
            seq = seqs[i]
            logprob, top = split_logprob_row(logprobs[i], seq.params.top_logprobs)
            seq.logprobs.append(logprob)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top)
        if self.pending:
            for seq, token in zip(seqs, tokens):
                ids = seq.token_ids
                ids[-1] = token
                ids.append(PLACEHOLDER)
                seq.num_computed_tokens += 1
        else:
            for seq, token in zip(seqs, tokens):
                seq.token_ids.append(token)
                seq.num_computed_tokens += 1
            self.last_ids = np.asarray(tokens, np.int32)
        c = self.computed
        c += 1
        if register is not None:
            for i in np.flatnonzero(c % self.block_size == 0).tolist():
                register(seqs[i])
