"""``TokenHandover``: what a step's sampled tokens do to their sequences once they reach the host.

Each token replaces its sequence's placeholder (the step after may have read it on the device already); then the
stop conditions (``StopChecker``, the model's position limit) may finish the sequence, which goes to the outbox, and
a prompt's first token starts its ``num_return_sequences`` copies. Most tokens take a fast path: an EOS and a
length check that end nothing.
"""

from __future__ import annotations

import operator

from hf_paged.engine import _validation as validation
from hf_paged.engine._inflight import InFlightStep
from hf_paged.engine._sequence import Sequence, SequenceStatus
from hf_paged.engine._steady_decode import SteadyDecode

_STATUS, _PENDING_ROW = operator.attrgetter("status"), operator.attrgetter("pending_row")


class TokenHandover:
    """The token hand-over half of :class:`EngineCore` (a mixin: it reads the core's ``_inflight``,
    ``stop_checker``, ``max_model_len``, ``counters``, ``scheduler``, ``block_manager`` and ``requests``), a steady
    decode step's fused hand-over and commit (:meth:`_take_steady`) included."""

    def _resolve(self) -> list[Sequence]:
        """Write the in-flight step's tokens into its sequences and apply stop conditions (waiting for the copy
        if it has not landed); sequences that finish go to the outbox. Returns the sequences that got a token."""
        step = self._inflight
        if step is None:
            return []
        tokens, logprobs = step.wait()
        self._inflight = None
        got = step.seqs
        if got and SequenceStatus.FINISHED not in map(_STATUS, got) and min(map(_PENDING_ROW, got)) >= 0:
            self._take_tokens(got, tokens, logprobs)  # (the usual case, checked at C speed)
            return got
        # some were aborted (or failed) while their token was in flight
        got = [seq for seq in got if seq.pending_row >= 0 and seq.status is not SequenceStatus.FINISHED]
        rows = [seq.pending_row for seq in got]
        self._take_tokens(got, [tokens[r] for r in rows], [logprobs[r] for r in rows])
        return got

    def _take_steady(self, steady: SteadyDecode, launched: InFlightStep | None) -> bool:
        """The hand-over and the commit of a steady decode step in one pass (``SteadyDecode.commit``), when its
        tokens end nothing and no sequence changed; False: the general hand-over and commit take the step."""
        step = launched if not steady.pending else self._inflight
        if (launched is None or step is None or self.scheduler.version != steady.version
                or (step.seqs is not steady.seqs and step.seqs != steady.seqs)):
            return False
        tokens = step.wait_array()
        if not steady.take_in(tokens):
            return False
        bm = self.block_manager
        logprobs = step.logprobs.tolist() if steady.logprob_rows else None
        steady.commit(tokens.tolist(), bm.register_full_blocks if bm.enable_prefix_caching else None, logprobs)
        self.counters.generated_tokens += len(steady.seqs)
        self._inflight = launched if steady.pending else None
        return True

    def _take_tokens(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float | None]) -> None:
        """Write each sequence's newest token in place of its placeholder and do its bookkeeping; a finished
        sequence goes to the outbox. A stop check that raises (the tokenizer, on stop strings) ends only its own
        sequence, with an error."""
        finish_reason, max_len = self.stop_checker.finish_reason, self.max_model_len
        self.counters.generated_tokens += len(seqs)
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            ids, params = seq.token_ids, seq.params
            ids[-1], seq.pending_row = token, -1
            n = len(ids)
            # Fast path (most tokens): nothing but an EOS and a length check, and neither ends the sequence.
            if (n < seq.stop_at and n < max_len and params.stops_on_eos_or_length and not seq.pending_children
                    and token not in params.eos_token_ids):
                continue
            if logprob is not None and seq.params.logprobs:
                seq.logprobs.append(logprob)
            if seq.pending_children and seq.num_generated == 1:
                self._fork(seq)
            error = None
            try:
                reason = finish_reason(seq)
            except Exception as exc:
                reason, error = "error", f"the stop check failed on this request: {type(exc).__name__}: {exc}"
            if reason is None and len(seq.token_ids) >= max_len:
                reason, error = "error", validation.reached_position_limit(seq.num_prompt_tokens, max_len)
            if reason is not None:
                self.scheduler.finish(seq, reason, error)
                self.requests.outbox.append(seq)

    def _fork(self, parent: Sequence) -> None:
        """Start the copies of ``num_return_sequences``: they share the prompt's blocks and recompute only its last
        token (into a private copy of the shared tail block) to draw their own first token."""
        n, parent.pending_children = parent.pending_children, 0
        prompt = parent.token_ids[: parent.num_prompt_tokens]
        for i in range(n):
            child = Sequence(f"{parent.request_id}{validation.CHILD_MARK}{i}", prompt, parent.params,
                             (parent.arrival[0], i + 1), (parent.seed * 1_000_003 + i + 1) % 2**62)
            self.requests.track(child)
            sched = self.scheduler
            room = len(sched.running) < sched.max_num_seqs and self.block_manager.tables.num_free_rows
            if room and parent.status is SequenceStatus.RUNNING:  # (preempted meanwhile: nothing to share)
                self.block_manager.fork(parent, child, len(prompt) - 1)
                sched.insert_running(child)
            else:
                sched.enqueue(child)

