"""``EngineCore``: one engine step, from the scheduler's choice to the tokens written into the sequences.

Each step schedules (``Scheduler``), plans flat tensors (``plan_step``), runs the model once over all scheduled
tokens packed in one row (``ModelRunner``, or a captured CUDA graph for a decode step), samples on the device
(``Sampler``) and copies the new tokens back in one transfer; with asynchronous scheduling it launches step N+1
before it takes in step N's tokens. A step commits whole or not at all: a failed launch is dropped and its batch
rerun one sequence at a time, so that only a faulty request ends with an error.

The requests' state is guarded by ``_lock`` (held by a step except during its device work) and Ctrl-C is held back
during the bookkeeping (``InterruptGuard``). Once a step's sampled tokens reach the host, each replaces its sequence's
placeholder, the stop conditions may finish the sequence (to the outbox), and a prompt's first token starts its
``num_return_sequences`` copies; most tokens take a fast path, an EOS and a length check that end nothing.
:class:`~hf_paged.Engine` adds requests and hands outputs over.
"""

from __future__ import annotations

import logging
import operator
import threading
from functools import partial
from itertools import compress

import torch

from hf_paged import _compat
from hf_paged.cache._block_manager import BlockManager
from hf_paged.engine import _sizing as sizing
from hf_paged.engine import _validation as validation
from hf_paged.engine._config import EngineConfig
from hf_paged.engine._detokenizer import Detokenizer
from hf_paged.engine._inflight import InFlightStep, TokenReceiver
from hf_paged.engine._interrupts import InterruptGuard
from hf_paged.engine._prompt_logprobs import prompt_rows, score
from hf_paged.engine._request_registry import RequestRegistry
from hf_paged.engine._sampler import Sampler, SamplingBatch, split_logprob_row
from hf_paged.engine._scheduler import ScheduledBatch, Scheduler
from hf_paged.engine._sequence import PLACEHOLDER, Sequence, SequenceStatus
from hf_paged.engine._sizing import Workload
from hf_paged.engine._stats import EngineStats
from hf_paged.engine._structured_output import StructuredOutput, advance as advance_grammar
from hf_paged.engine._weights import WeightWatch
from hf_paged.hf._register import ATTN_IMPLEMENTATION, use_paged_attention
from hf_paged.runner._model_runner import ModelRunner

logger = logging.getLogger("hf_paged")
_status, _pending_row = operator.attrgetter("status"), operator.attrgetter("pending_row")


def restore_attention(model: torch.nn.Module, implementation: str | None) -> None:
    """Switch ``model`` back to ``implementation``, the attention it ran before an engine switched it to the paged
    one, so that its own ``generate`` and transformers' ``generate_batch`` run as the caller loaded them; a model
    switched elsewhere since (or loaded with the paged attention) is left as it is."""
    now = _compat.attn_implementation(model.config)
    if implementation in (None, ATTN_IMPLEMENTATION) or now != ATTN_IMPLEMENTATION:
        return
    logger.info("hf_paged: switching the model's attention back to %r", implementation)
    model.set_attn_implementation(implementation)


class EngineCore:
    """The scheduler, the requests and the sampler of ``model``, its ``ModelRunner``, and the step that drives them."""

    def __init__(self, model: torch.nn.Module, cfg: EngineConfig, tokenizer=None, workload: Workload | None = None):
        self.attention_before = _compat.attn_implementation(model.config)  # put back by close() and generate_batch
        use_paged_attention(model)
        self.model, self.tokenizer, self.device = model, tokenizer, model.device
        self.max_model_len = max_len = validation.position_limit(model.config)
        # A sequence's most tokens (the block tables' width): for a one-call engine its workload's longest (+1 token:
        # a stopped sequence's step of lag), else the model's position limit.
        longest = max_len if workload is None or not workload.one_call else min(
            max_len, max(workload.sequence_tokens, default=max_len) + 1)
        size = partial(sizing.size_for, model.config, model.dtype, max_len, workload)
        self.runner = runner = ModelRunner(model, cfg, size, longest)
        self.config = cfg = runner.config
        self.sizing = runner.sizing  # the automatic settings, each with why it was picked
        self.block_manager = BlockManager(runner.pool.allocator, cfg.block_size, runner.tables, runner.pool.copy_blocks,
                                          cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_tokens, cfg.max_num_seqs)
        self.vocab_size = vocab = model.config.get_text_config(decoder=True).vocab_size
        self.sampler, self.structured = Sampler(cfg.logprobs_mode), StructuredOutput(tokenizer, vocab)
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None  # (text, and stop strings)
        self.counters, self.requests = EngineStats(), RequestRegistry()
        self.async_scheduling = self.device.type == "cuda" if cfg.async_scheduling is None else cfg.async_scheduling
        self._receiver = TokenReceiver(cfg.max_num_seqs, self.device)
        self._inflight: InFlightStep | None = None  # the launched step whose tokens are on their way
        self._interrupts, self._lock = InterruptGuard(), threading.Lock()  # the lock: the requests' state
        self.weights = WeightWatch(model)  # the weights the KV is computed with
        logger.info("hf_paged: engine on %s: %s", self.device, sizing.describe(cfg, self.sizing,
                                                                            runner.graphs is not None))

    def _advance(self) -> list[Sequence]:
        """One step: schedule, run the model, sample, and take in the tokens of the step before (asynchronous
        scheduling: the host's bookkeeping runs while the device computes) or of this one (synchronous). Sequences
        that finish go to the outbox; returns those that got a token."""
        clock = self.counters.clock()
        touched = self._before_step()
        batch, scheduled = self._schedule()
        touched += scheduled
        clock("schedule")
        if not batch.seqs:
            touched += self._resolve()
        else:
            self.counters.note_step(self.runner.pool.allocator.num_used)  # (a rerun one by one counts as its step)
            try:
                launched = self._launch(batch)
            except BaseException as exc:
                return touched + self._launch_failed(batch, exc)
            clock("forward")
            touched += self._resolve()
            clock("sample")
            self._commit(batch, launched)
        if not self.async_scheduling:
            touched += self._resolve()
        clock("update")
        return touched

    # ----- the hooks around a step -----------------------------------------------------------------------------
    def check_weights(self) -> bool:
        """Find the changes of the model's weights that leave the version counters alone (each step compares those):
        values written through ``param.data``, parameters replaced, or moved to another dtype or device. Written
        values make the engine forget its KV at the next step; False where a parameter was replaced or its storage,
        dtype or device changed, whose pool, CUDA graphs and packed weights hold the old ones (make a new engine).
        Costs a few microseconds per parameter (0.9 ms for SmolLM2-135M's 272 on a CPU) plus a copy of 64 values of
        each (a sample spread over every tensor: a write through ``param.data`` to a few rows only may go unseen;
        ``reset_prefix_cache()`` covers it)."""
        return self.weights.check()

    def _before_step(self) -> list[Sequence]:
        """The hook before scheduling: the weights check (KV computed with other weights is forgotten). Returns the
        sequences that got a token."""
        if self.weights.changed():
            return self._forget_kv()
        return []

    def _schedule(self) -> tuple[ScheduledBatch, list[Sequence]]:
        """The scheduler's batch (under tensor parallel every rank checks that all scheduled the same, or all raise);
        the sequences that ended outside a step (errors, aborts, those the scheduler failed) go to the outbox.
        A repetition penalty or a grammar reads a sequence's tokens before its step: where such a sequence waits on
        the in-flight step, its tokens are taken in first (the sequences that finish leave the batch). Returns the
        batch and the sequences that got a token."""
        batch, touched = self.scheduler.schedule(), []
        self.requests.outbox += self.scheduler.take_failed()
        if self.runner.lockstep is not None:
            self.runner.lockstep.check(batch.seqs, batch.num_tokens)
        if self._inflight is not None and any(s.pending_row >= 0 and s.params.reads_own_tokens for s in batch.seqs):
            touched = self._resolve()
            batch = _without_finished(batch)
        return batch, touched

    def _launch_failed(self, batch: ScheduledBatch, exc: BaseException) -> list[Sequence]:
        """The batch did not run (its blocks stay reserved, its KV is rewritten when it runs): take in the step
        before's tokens, which the failed launch may have overwritten on the device, and rerun the batch one
        sequence at a time. Under tensor parallel the ranks cannot rerun apart: all raise."""
        if self.runner.lockstep is not None and isinstance(exc, Exception):
            self.runner.lockstep.fail(exc)
        touched = self._resolve()
        if not isinstance(exc, Exception):
            raise exc
        # each sequence alone (synchronously): one that fails again ends with finish_reason="error" (the fault is its
        # own), the others go on as if nothing happened
        batch = _without_finished(batch)
        logger.warning("hf_paged: a step of %d sequences failed (%s: %s); running them one by one to find the "
                       "faulty ones", len(batch.seqs), type(exc).__name__, exc)
        for seq, n, smp in zip(batch.seqs, batch.num_tokens, batch.sample):
            if seq.is_finished:
                continue
            alone = ScheduledBatch([seq], [n], [smp])
            try:
                launched = self._launch(alone)
            except Exception as err:
                if not seq.is_finished:  # (an abort from another thread may land while it runs)
                    self._finish(seq, "error", f"the model failed on this request: {type(err).__name__}: {err}")
                continue
            self._commit(alone, launched)
            touched += self._resolve()
        return touched

    def _forget_kv(self) -> list[Sequence]:
        """Drop every KV computed with the weights the model had before: the in-flight step's tokens are taken in
        (they were sampled already), every running sequence is queued to be computed afresh with its tokens so far,
        no prefix stays findable, and fp8 scales are fixed anew. Returns the sequences that got a token."""
        touched = self._resolve()
        self.scheduler.recompute_all()
        dropped = self.block_manager.reset_prefix_cache()
        self.runner.pool.clear_scales()
        self.weights.settle()
        self.counters.kv_resets += 1
        logger.info("hf_paged: the KV computed so far is forgotten (%d cached blocks; the model's weights changed, "
                    "or reset_prefix_cache()); running requests are computed afresh", dropped)
        return touched

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason, error)
        self.requests.outbox.append(seq)

    def _launch(self, batch: ScheduledBatch) -> InFlightStep | None:
        """Run the model and sample on the device; the sampled tokens start their copy to the host. Called with the
        lock held: what reads the sequences (``runner.prepare``) runs under it, the device work and the sampler
        without it, so other threads may add and abort requests meanwhile (an abort is applied when the step
        commits)."""
        sampled = list(compress(batch.seqs, batch.sample))
        scored = prompt_rows(batch.seqs, batch.num_tokens)
        prepared = self.runner.prepare(batch, scored.rows if scored is not None else None)
        self._lock.release()  # (signals' handlers received during the device work run as it ends)
        try:
            with self._interrupts.allowed():
                logits = self.runner.run(prepared)
                if scored is not None:
                    logits, extra = logits[: len(sampled)], logits[len(sampled) :]
                    shards = self.runner.vocab_shards
                    scores = score(extra if shards is None else shards.gather(extra), scored)
                launched = self._sample(sampled, logits)
        finally:
            self._lock.acquire()  # (with the handlers held again)
        if scored is not None:
            for (seq, _), values in zip(scored.owners, scores):
                seq.prompt_logprobs.extend(values)
        return launched

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor) -> InFlightStep | None:
        if not sampled:
            return None
        shards, lockstep = self.runner.vocab_shards, self.runner.lockstep
        sampling = SamplingBatch.build(sampled, logits.shape[-1] if shards is None else shards.vocab, logits.device)
        if shards is None:
            (tokens, logprobs), agreed = self.sampler(logits, sampling), False
        else:
            tokens, logprobs, agreed = shards.sample(self.sampler, logits, sampling)
        if lockstep is not None and not agreed:
            lockstep.share(tokens, logprobs)  # the leading rank's tokens, so every rank feeds the same ids
        self.runner.keep_tokens(tokens)  # what the next step may read
        return self._receiver.send(sampled, tokens, logprobs)

    def _commit(self, batch: ScheduledBatch, launched: InFlightStep | None) -> None:
        """Record the step's KV as written and give its sampled sequences a placeholder for their new token;
        sequences that finished meanwhile (their step before was their last) are left out."""
        seqs, bm = batch.seqs, self.block_manager
        if (launched is not None and len(launched.seqs) == len(seqs) == sum(batch.num_tokens)
                and SequenceStatus.FINISHED not in map(_status, seqs)):
            # the usual decode step: every sequence computed one token and sampled the next, committed in one pass
            bs, register = bm.block_size, bm.register_full_blocks if bm.enable_prefix_caching else None
            for row, seq in enumerate(seqs):
                c = seq.num_computed_tokens = seq.num_computed_tokens + 1
                seq.token_ids.append(PLACEHOLDER)
                seq.pending_row = row
                if register is not None and c // bs > seq.num_hashed_blocks:
                    register(seq)
            self._inflight = launched
            return
        kept = _without_finished(batch)
        bm.commit(kept.seqs, kept.num_tokens)  # (their KV is written now)
        if launched is not None:
            for row, seq in enumerate(launched.seqs):
                if not seq.is_finished:
                    seq.token_ids.append(PLACEHOLDER)
                    seq.pending_row = row
            self._inflight = launched

    # ----- taking in a step's tokens -------------------------------------------------------------------------

    def _resolve(self) -> list[Sequence]:
        """Write the in-flight step's tokens into its sequences and apply stop conditions (waiting for the copy
        if it has not landed); sequences that finish go to the outbox. Returns the sequences that got a token."""
        step = self._inflight
        if step is None:
            return []
        tokens, logprobs = step.wait()
        self._inflight = None
        got = step.seqs
        if got and SequenceStatus.FINISHED not in map(_status, got) and min(map(_pending_row, got)) >= 0:
            self._take_tokens(got, tokens, logprobs)  # (the usual case, checked at C speed)
            return got
        # some were aborted (or failed) while their token was in flight
        got = [seq for seq in got if seq.pending_row >= 0 and seq.status is not SequenceStatus.FINISHED]
        rows = [seq.pending_row for seq in got]
        self._take_tokens(got, [tokens[r] for r in rows], [logprobs[r] for r in rows])
        return got

    def _take_tokens(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float | None]) -> None:
        """Write each sequence's newest token in place of its placeholder and do its bookkeeping; a finished
        sequence goes to the outbox. A stop check that raises (the tokenizer, on stop strings) ends only its own
        sequence, with an error."""
        stop_reason, max_len = self._stop_reason, self.max_model_len
        self.counters.generated_tokens += len(seqs)
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            ids, params = seq.token_ids, seq.params
            ids[-1], seq.pending_row = token, -1
            n = len(ids)
            # Fast path (most tokens): nothing but an EOS and a length check, and neither ends the sequence.
            if (n < seq.stop_at and n < max_len and params.stops_on_eos_or_length and not seq.pending_children
                    and token not in params.eos_token_ids):
                continue
            if logprob is not None and params.logprobs:
                logprob, top = split_logprob_row(logprob, params.top_logprobs)
                seq.logprobs.append(logprob)
                if params.top_logprobs:
                    seq.top_logprobs.append(top)
            if seq.pending_children and seq.num_generated == 1:
                self._fork(seq)
            error = None
            try:
                reason = stop_reason(seq)
                if seq.grammar is not None and reason is None:
                    reason, error = advance_grammar(seq.grammar, token, params.eos_token_ids)
            except Exception as exc:
                reason, error = "error", f"the stop check failed on this request: {type(exc).__name__}: {exc}"
            if reason is None and len(seq.token_ids) >= max_len:
                reason, error = "error", (f"reached the model's position limit ({max_len} tokens, "
                                          f"max_position_embeddings) before max_new_tokens; ask for at most "
                                          f"{max_len - seq.num_prompt_tokens} new tokens with this prompt")
            if reason is not None:
                self._finish(seq, reason, error)

    def _stop_reason(self, seq: Sequence) -> str | None:
        """Whether ``seq`` is done after its newest token: ``"stop"`` (EOS or a stop string), ``"length"`` or None
        (keep going). EOS cannot come before ``min_new_tokens``: the sampler suppresses it."""
        params = seq.params
        eos = seq.token_ids[-1] in params.eos_token_ids
        length = len(seq.token_ids) >= seq.stop_at  # (its max_new_tokens reached)
        # (before the EOS: an EOS that is not a special token has text, which may complete a stop string); all the
        # tokens are read when the sequence ends with this one anyway
        if params.stop_strings:
            self.detokenizer.read(seq, flush=eos or length)
            if seq.text_state.stop_at is not None:
                return "stop"
        return "stop" if eos else "length" if length else None

    def _fork(self, parent: Sequence) -> None:
        """Start the copies of ``num_return_sequences``: they share the prompt's blocks and recompute only its last
        token (into a private copy of the shared tail block) to draw their own first token."""
        n, parent.pending_children = parent.pending_children, 0
        prompt = parent.token_ids[: parent.num_prompt_tokens]
        for i in range(n):
            child = Sequence(f"{parent.request_id}{validation.CHILD_MARK}{i}", prompt, parent.params,
                             (parent.arrival[0], i + 1), (parent.seed * 1_000_003 + i + 1) % 2**62)
            child.prompt_logprobs = list(parent.prompt_logprobs)
            child.grammar = self.structured.matcher(parent.params.json_schema)
            self.requests.track(child)
            sched = self.scheduler
            room = len(sched.running) < sched.max_num_seqs and self.block_manager.tables.num_free_rows
            if room and parent.status is SequenceStatus.RUNNING:  # (preempted meanwhile: nothing to share)
                self.block_manager.fork(parent, child, len(prompt) - 1)
                sched.insert_running(child)
            else:
                sched.enqueue(child)


def _without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    if SequenceStatus.FINISHED not in map(_status, batch.seqs):  # (the usual case, checked at C speed)
        return batch
    keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
    return ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_tokens[i] for i in keep],
                          [batch.sample[i] for i in keep])


