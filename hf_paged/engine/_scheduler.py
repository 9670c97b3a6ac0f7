"""``Scheduler``: continuous batching with mixed prefill + decode steps, chunked prefill and preemption.

Every step spends a token budget (``max_batch_tokens``) over sequences in arrival order:

1. Running sequences first, oldest first: a decode takes 1 token, an unfinished prefill the next chunk. When the
   free blocks cannot hold a sequence's tokens, the newest running sequence is preempted (its blocks are freed and
   it goes back to the front of the queue keeping its generated tokens; it is recomputed later, hitting the prefix
   cache where its blocks survived). The oldest sequence is never preempted for a newer one, so every request
   finishes (no starvation).
2. Then waiting sequences, strictly FIFO, while tokens, rows and free blocks remain; a prompt longer than what is
   left is prefilled in chunks. Nothing is admitted in a step that had to preempt.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from hf_paged.cache._block_manager import BlockManager
from hf_paged.engine._request_registry import family
from hf_paged.engine._sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's choice: ``seqs[i]`` computes its next ``num_tokens[i]`` tokens; ``sample[i]``: it then samples."""

    seqs: list[Sequence]
    num_tokens: list[int]
    sample: list[bool]


class Scheduler:
    """Owns the waiting queue and the running list; the block manager owns their blocks."""

    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0
        self.failed: list[Sequence] = []  # finished outside a step (errors, aborts), reported by the next step

    def add(self, seq: Sequence, error: str | None = None) -> None:
        """Queue a new sequence; with ``error`` (the engine refused it at the door) end it at once instead, reported by
        the next step."""
        if error is None:
            self.waiting.append(seq)
        else:
            seq.finish("error", error)
            self.failed.append(seq)

    def enqueue(self, seq: Sequence) -> None:
        """Put a sequence holding no blocks back in the queue at its arrival place (a preempted one goes first)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(bisect.bisect(self.waiting, seq.arrival, key=lambda s: s.arrival), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.failed)

    @property
    def live(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)

    # ----- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_batch_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        partial: list[int] = []  # positions in ``seqs`` of chunks that stop short of the sequence's end
        preempted = False
        running, bm = self.running, self.block_manager
        reserve_up_to, refs, bs = bm.reserve_up_to, bm.allocator.ref_counts, bm.block_size
        add_seq, add_count = seqs.append, counts.append
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens = len(seq.token_ids)
            if num_tokens >= seq.stop_at:  # its last token is in flight
                i += 1
                continue
            c = seq.num_computed_tokens
            n = num_tokens - c
            # Fast path (most decode steps): one token that fits the last block, which only this sequence holds.
            if n != 1 or not c % bs or refs[seq.block_table[c // bs]] != 1:
                n = reserve_up_to(seq, n if n < budget else budget)
                if n == 0:  # no block is free: preempt the newest sequence (this one if it is the newest) ...
                    if len(running) > 1:
                        self._preempt(running[-1])
                    else:  # ... or fail it if it runs alone and still does not fit
                        self._fail(seq)
                    preempted = True
                    if seq.status is not SequenceStatus.RUNNING:  # preempted itself or failed: the list shrank to i
                        break
                    continue  # a newer sequence was preempted; try again
                if c + n != num_tokens:
                    partial.append(len(seqs))
            add_seq(seq)
            add_count(n)
            budget -= n
            i += 1
        sample = [True] * len(seqs)
        for j in partial:
            sample[j] = False
        if not preempted:
            self._admit(budget, seqs, counts, sample)
        return ScheduledBatch(seqs, counts, sample)

    def _admit(self, budget: int, seqs: list[Sequence], counts: list[int], sample: list[bool]) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and bm.tables.num_free_rows:
            seq = self.waiting[0]
            hits = bm.find_prefix(seq) if not seq.needs_prompt_logprobs else []  # (its prompt must be computed)
            n = bm.max_tokens_fitting(seq, min(seq.num_tokens - len(hits) * bm.block_size, budget), hits)
            if n == 0:
                if not self.running:  # the whole cache cannot hold it
                    self._fail(seq)
                    continue
                break
            self.waiting.popleft()
            bm.admit(seq, hits)
            bm.reserve(seq, n)
            self.insert_running(seq)
            seqs.append(seq)
            counts.append(n)
            sample.append(seq.num_computed_tokens + n == len(seq.token_ids))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.enqueue(seq)
        self.num_preemptions += 1

    def recompute_all(self) -> None:
        """Free every running sequence's blocks and queue it again, its tokens kept: its KV is computed afresh when it
        runs next (once the model's weights have changed). Unlike a preemption, nothing is counted."""
        for seq in reversed(self.running):
            self.block_manager.free(seq)
            self.enqueue(seq)
        self.running.clear()

    def _fail(self, seq: Sequence) -> None:
        """Finish a sequence that needs more blocks than the whole cache holds."""
        bm = self.block_manager
        self.finish(seq, "error", (
            f"this sequence needs more KV-cache blocks than the cache holds ({bm.allocator.num_blocks} blocks of "
            f"{bm.block_size} tokens for {seq.num_tokens} tokens); create the Engine with more num_blocks or ask "
            "for fewer max_new_tokens"
        ))
        self.failed.append(seq)

    # ----- after the forward -----------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a live sequence: its blocks go back (full ones stay findable in the prefix cache). Under
        asynchronous scheduling a sequence may learn that it is done while preempted (waiting)."""
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason, error)

    def insert_running(self, seq: Sequence) -> None:
        """Add a sequence that already holds blocks (a forked copy) to the running list."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` with ``"abort"`` (reported by the next step); returns them."""
        hit = [s for s in self.live if family(s.request_id) == request_id]
        for seq in hit:
            self.finish(seq, "abort")
        self.failed += hit
        return hit

    def take_failed(self) -> list[Sequence]:
        """The sequences finished outside a step (errors, aborts) since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def discard_failed(self, families: set[str]) -> None:
        """Forget the finished-outside-a-step sequences of ``families``, whose reader left."""
        self.failed = [s for s in self.failed if family(s.request_id) not in families]

    def check_invariants(self) -> None:
        live = self.live
        self.block_manager.check_invariants(live)
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in self.waiting)
        assert [s.arrival for s in self.running] == sorted(s.arrival for s in self.running)
        assert [s.arrival for s in self.waiting] == sorted(s.arrival for s in self.waiting)
        assert len(self.running) <= self.max_num_seqs
