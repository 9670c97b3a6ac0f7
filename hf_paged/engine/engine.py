"""``Engine``: continuous batching over a :class:`~hf_paged.PagedAttentionCache`.

Requests join and leave the running batch every step; each step schedules (``Scheduler``), plans flat tensors
(``plan_step``), runs the model once over all scheduled tokens packed in one row (``ModelRunner``), samples on the
device (``Sampler``) and copies the new tokens back in one transfer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence as SequenceType
from contextlib import contextmanager
from dataclasses import replace

import torch
from transformers import GenerationConfig

from hf_paged.cache.kv_pool import KVLayout, blocks_for_budget
from hf_paged.cache.paged_cache import PagedAttentionCache
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.block_table_buffer import BlockTableBuffer
from hf_paged.engine.config import EngineConfig
from hf_paged.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from hf_paged.engine.detokenizer import Detokenizer
from hf_paged.engine.request_output import RequestOutput, TokenDelta
from hf_paged.engine.request_registry import RequestRegistry, family
from hf_paged.engine.runner import ModelRunner, plan_step
from hf_paged.engine.sampler import Sampler, SamplingBatch
from hf_paged.engine.sampling_params import SamplingParams
from hf_paged.engine.inflight import InFlightStep, TokenReceiver
from hf_paged.engine.interrupts import InterruptGuard
from hf_paged.engine.scheduler import ScheduledBatch, Scheduler
from hf_paged.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from hf_paged.engine.stop_checker import StopChecker
from hf_paged.engine.stats import EngineStats
from hf_paged.engine import validation
from hf_paged.hf.register import ATTN_IMPLEMENTATION

logger = logging.getLogger("hf_paged")

Prompt = SequenceType[int] | str


class Engine:
    """Continuous-batching generation for a decoder-only transformers model.

    Args:
        model: a causal LM; its attention is switched to ``"hf_paged"`` if it was loaded with another one.
        num_blocks: KV blocks in the pool; None sizes the pool from free device memory (``memory_budget``).
        block_size: tokens per block.
        max_batch_tokens: token budget of one step (prefill chunks and decodes together).
        max_num_seqs: most sequences running at once.
        tokenizer: needed for string prompts, stop strings and ``text`` in outputs.
        generation_config: default settings of requests added without one (default: the model's).
        enable_prefix_caching: reuse the KV of full blocks whose prefix was computed before.
        backend: restrict attention to these backends, in order (``hf_paged.available_backends()``).
        memory_budget: with ``num_blocks=None``, the fraction of free device memory the pool may take.
        cuda_graphs: on a CUDA device, capture decode steps as CUDA graphs at start (one per padded batch size,
            ``graph_batch_sizes(max_num_seqs)``, or the sizes given) and replay them; False runs every step eager.
            Graphs are switched off, with a log line saying why, when a backend serving decode is not capture-safe.
        async_scheduling: launch each step before taking in the tokens of the one before, so the host schedules
            while the device computes (one step of lag: a sequence that stops computes one token more, which is
            dropped). None: on for CUDA devices, off on the CPU (where nothing runs in parallel).
        config: the settings above as one :class:`EngineConfig` instead of keywords (not both).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int | None = EngineConfig.num_blocks,
        block_size: int = EngineConfig.block_size,
        max_batch_tokens: int = EngineConfig.max_batch_tokens,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        tokenizer=None,
        generation_config: GenerationConfig | None = None,
        enable_prefix_caching: bool = EngineConfig.enable_prefix_caching,
        backend: str | SequenceType[str] | None = EngineConfig.backend,
        memory_budget: float = EngineConfig.memory_budget,
        cuda_graphs: bool | SequenceType[int] = EngineConfig.cuda_graphs,
        async_scheduling: bool | None = EngineConfig.async_scheduling,
        config: EngineConfig | None = None,
    ):
        cfg = _engine_config(config, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=max_batch_tokens,
                             max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching, backend=backend,
                             memory_budget=memory_budget, cuda_graphs=cuda_graphs, async_scheduling=async_scheduling)
        _use_paged_attention(model)
        self.model, self.tokenizer = model, tokenizer
        self.generation_config = (validation.generation_config(generation_config)
                                  or getattr(model, "generation_config", None) or GenerationConfig())
        self.device, dtype = model.device, model.dtype
        self.max_model_len = max_len = validation.position_limit(model.config)
        block_size, max_num_seqs = cfg.block_size, cfg.max_num_seqs
        if cfg.num_blocks is None:
            cfg = replace(cfg, num_blocks=blocks_from_memory(model.config, block_size, dtype, self.device,
                                                             cfg.memory_budget,
                                                             cap=max_num_seqs * -(-max_len // block_size)))
        self.config = cfg
        self.cache = PagedAttentionCache(model.config, cfg.num_blocks, block_size, self.device, dtype,
                                         backend=cfg.backend)
        tables = BlockTableBuffer(max_num_seqs, min(cfg.num_blocks, -(-max_len // block_size)))
        self.block_manager = BlockManager(self.cache.pool.allocator, block_size, tables,
                                          self.cache.pool.copy_blocks, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_tokens, max_num_seqs)
        self.runner = ModelRunner(model, self.cache, cfg.max_batch_tokens, self.device, max_seqs=max_num_seqs,
                                  max_blocks_per_seq=tables.table.shape[1])
        self.sampler = Sampler()
        self.stop_checker = StopChecker(tokenizer)
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.counters = EngineStats()
        self.requests = RequestRegistry()
        auto = cfg.async_scheduling is None
        self.async_scheduling = self.device.type == "cuda" if auto else cfg.async_scheduling
        self._receiver = TokenReceiver(max_num_seqs, self.device)
        self._inflight: InFlightStep | None = None
        self._interrupts = InterruptGuard()
        self._lock = threading.Lock()  # the requests' state: held by a step except during its device work
        self._step_running = False
        self._stepper: int | None = None  # the thread inside a step
        self._to_cancel: list[set[str]] = []  # families whose reader left during a step of its own thread
        self.graphs = self._capture_graphs(cfg.cuda_graphs, tables, max_num_seqs)

    def _capture_graphs(self, cuda_graphs, tables: BlockTableBuffer, max_num_seqs: int) -> DecodeGraphs | None:
        if cuda_graphs is False or self.device.type != "cuda":
            return None
        sizes = graph_batch_sizes(max_num_seqs) if cuda_graphs is True else [s for s in cuda_graphs if s <= max_num_seqs]
        graphs = DecodeGraphs(self.model, self.cache, tables, sizes, self.runner.last_tokens)
        reason = graphs.capture()
        if reason is not None:
            logger.info("hf_paged: decode runs without CUDA graphs: %s", reason)
            return None
        return graphs

    # ----- requests --------------------------------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt, generation_config: GenerationConfig | None = None, request_id: str | int | None = None
    ) -> str:
        """Queue a prompt (token ids, or a string with a tokenizer); returns its request id.

        Raises ``ValueError`` (one line, nothing queued) for anything the engine cannot serve: an empty prompt,
        token ids that are not integers of the vocabulary, invalid or unserved sampling settings, a duplicate live
        ``request_id``. A prompt that can never run (longer than the whole cache, or leaving no room within the
        model's position limit) finishes with ``finish_reason="error"`` and a message instead.
        """
        seq = self._new_sequence(prompt, generation_config, request_id)
        return self._enqueue([seq])[0]

    def _new_sequence(self, prompt: Prompt, config: GenerationConfig | None, request_id) -> Sequence:
        """Validate a request and build its sequence (id and arrival are given when it is queued); changes
        nothing in the engine."""
        ids = validation.prompt_token_ids(prompt, self.vocab_size, self.tokenizer)
        params = SamplingParams.from_generation_config(
            validation.generation_config(config) or self.generation_config, len(ids),
            getattr(self.model, "generation_config", None))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: create the Engine with tokenizer=...")
        seed = params.seed if params.seed is not None else int(torch.randint(2**31 - 1, ()).item())
        return Sequence(validation.request_id(request_id), ids, params, (0, 0), seed, params.num_return_sequences - 1)

    def _enqueue(self, seqs: list[Sequence]) -> list[str]:
        """Give each sequence its id and arrival, and queue it (or fail it at once if it can never run)."""
        with self._lock:
            return self._enqueue_locked(seqs)

    def _enqueue_locked(self, seqs: list[Sequence]) -> list[str]:
        for seq in seqs:
            seq.request_id, arrival = self.requests.new_id(seq.request_id)
            seq.arrival = (arrival, 0)
            self.requests.track(seq)
            self.counters.prompt_tokens += seq.num_tokens
            error = self._never_runs(seq)
            if error is not None:
                seq.finish("error", error)
                self.scheduler.failed.append(seq)
            else:
                self.scheduler.add(seq)
        return [seq.request_id for seq in seqs]

    def _never_runs(self, seq: Sequence) -> str | None:
        bs, num_blocks = self.cache.block_size, self.cache.num_blocks
        if seq.num_tokens >= self.max_model_len:
            return validation.past_position_limit(seq.num_tokens, self.max_model_len)
        if -(-seq.num_tokens // bs) > num_blocks:
            return (f"the prompt ({seq.num_tokens} tokens) is longer than the whole KV cache ({num_blocks} blocks "
                    f"of {bs}); create the Engine with more num_blocks")
        return None

    def abort(self, request_id: str | int) -> None:
        """Stop a request (and its copies); its output, with ``finish_reason="abort"``, comes from the next step.
        An id that is not live (unknown, or finished already) is ignored."""
        rid = validation.request_id(request_id)
        with self._lock:
            self.scheduler.failed.extend(self.scheduler.abort(rid))

    def abort_all(self) -> list[str]:
        """Abort every live request (as :meth:`abort` does); returns the ids of the sequences stopped."""
        stopped = []
        with self._lock:
            for rid in dict.fromkeys(family(s.request_id) for s in self.scheduler.live):
                stopped += self.scheduler.abort(rid)
            self.scheduler.failed.extend(stopped)
        return [s.request_id for s in stopped]

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, in flight, or finished but not handed over yet."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self.requests.outbox)

    # ----- running ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that finished (under asynchronous scheduling: whose last
        token arrived) during it, and of requests that failed or were aborted since the step before."""
        return self._step(want_deltas=False)[0]

    def stream(
        self, prompts: list[Prompt] | None = None, generation_config: GenerationConfig | None = None
    ) -> Iterator[TokenDelta]:
        """Yield each request's new tokens, step by step, as :class:`TokenDelta`.

        With ``prompts``: add them, and stream them (and only them) until they are done; closing the generator
        early (``break``, ``close()``, garbage collection) aborts those of them still running, and their outputs are
        dropped with them. Without: stream every request until none is left; closing early aborts nothing.
        Nothing else is dropped: a delta counts as handed over once it has been yielded, and a finished request
        that was not yielded yet stays in the engine for the next ``step()`` or ``stream()``.
        """
        owned = None
        if prompts is not None:
            owned = set(self._enqueue(self._new_sequences(prompts, generation_config, "stream")))
        try:
            while self.requests.any_open(owned) if owned is not None else self.has_unfinished():
                with self._stepping():
                    touched = self._advance()
                    ready = [(seq, seq in self.requests.outbox) for seq in self._stream_order(touched, owned)]
                for seq, final in ready:
                    with self._lock:
                        delta = self._peek_delta(seq, final)
                    if delta is None:
                        continue
                    try:
                        yield delta
                    finally:  # runs once the consumer has the delta, whether it goes on or closes the stream
                        with self._interrupts.held(), self._lock:
                            self._hand_over_delta(seq, delta)
        finally:
            if owned:
                self._cancel(owned)

    def generate(
        self,
        prompts: list[Prompt],
        generation_config: GenerationConfig | list[GenerationConfig] | None = None,
        progress_bar: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (one config for all, or one per prompt); outputs in prompt order, a prompt's
        ``num_return_sequences`` copies together. Every prompt is checked before any is queued. Requests added by
        others meanwhile are stepped too but not reported here (the next ``step()`` does). Interrupted (Ctrl-C, or
        an exception), it aborts its requests before the exception leaves, so the engine is ready for the next
        call."""
        ids = self._enqueue(self._new_sequences(prompts, generation_config, "generate"))
        owned, done = set(ids), []
        from tqdm.auto import tqdm

        try:
            with tqdm(total=len(ids), disable=not progress_bar, unit="request") as bar:
                while self.requests.any_open(owned):
                    outs = self._step(want_deltas=False, owned=owned)[0]
                    done += outs
                    bar.update(sum(not self.requests.is_open(rid) for rid in {family(o.request_id) for o in outs}))
        except BaseException:
            self._cancel(owned)
            raise
        by_request: dict[str, list[RequestOutput]] = {}
        for out in done:
            by_request.setdefault(family(out.request_id), []).append(out)
        return [o for rid in ids for o in sorted(by_request[rid], key=_copy_index)]

    def _new_sequences(self, prompts, config, what: str) -> list[Sequence]:
        """Validate every prompt (and its config) before any is queued."""
        prompts = validation.prompt_list(prompts, what)
        configs = validation.generation_configs(config, len(prompts))
        return [self._new_sequence(p, c, None) for p, c in zip(prompts, configs)]

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests and debugging): block reference counts match the live
        sequences' tables, free + used blocks make the pool, every live or finished sequence has an open request."""
        with self._lock:
            self.scheduler.check_invariants()
            alloc = self.block_manager.allocator
            assert alloc.num_free + alloc.num_used == alloc.num_blocks
            held = self.scheduler.live + self.scheduler.failed + self.requests.outbox
            assert all(self.requests.open.get(s.request_id) is s for s in held), "a sequence without its request"
            assert all(s.is_finished for s in self.requests.outbox + self.scheduler.failed)

    def stats(self) -> dict:
        """Blocks, preemptions, prefix-cache hits, token counts and which attention backend served each phase."""
        with self._lock:
            return self.counters.snapshot(self)

    # ----- internals -------------------------------------------------------------------------------------------
    def _step(self, want_deltas: bool, owned: set[str] | None = None) -> tuple[list[RequestOutput], list[TokenDelta]]:
        """One step, then hand over the finished requests of ``owned`` (None: all) waiting in the outbox, and the
        new tokens of the rest when ``want_deltas``. A Ctrl-C during the step is raised once the state is
        consistent, before anything is handed over: the outbox then waits for the next call."""
        with self._stepping():
            touched = self._advance()
            self._interrupts.raise_pending()
            self._apply_cancels()
            clock = self.counters.clock()
            finished = self.requests.take(owned)
            outputs = [self._output(s) for s in finished]
            deltas = self._deltas(touched, finished) if want_deltas else []
            clock("update")
        return outputs, deltas

    @contextmanager
    def _stepping(self) -> Iterator[None]:
        """Hold the lock (Ctrl-C held back) for a step; steps come from one thread at a time."""
        with self._interrupts.held(), self._lock:
            if self._step_running:
                raise RuntimeError("a step is running in another thread: step(), stream() and generate() must be "
                                   "called from one thread at a time (add_request and abort from any)")
            self._step_running, self._stepper = True, threading.get_ident()
            try:
                self._apply_cancels()
                yield
                self._apply_cancels()
            finally:
                self._step_running, self._stepper = False, None

    def _stream_order(self, touched: list[Sequence], owned: set[str] | None) -> list[Sequence]:
        """The sequences a stream hands a delta to after a step: those that got tokens, then the finished ones."""
        seqs = dict.fromkeys(touched + self.requests.outbox)
        return [s for s in seqs if owned is None or family(s.request_id) in owned]

    def _peek_delta(self, seq: Sequence, final: bool) -> TokenDelta | None:
        """The delta ``seq`` has ready (None: nothing new), handing nothing over; ``final``: ``seq`` is in the
        outbox (its finish is reported only then: an abort from another thread reaches the outbox with the next
        step). With a tokenizer, the tokens and text are those the detokenizer lets out (see ``detokenizer.py``)."""
        tokens, text = seq.output_token_ids, None
        if self.detokenizer is None:
            new = tokens[seq.num_streamed :]
        else:
            sent = self.detokenizer.state(seq).sent
            try:
                if final:
                    kept, full = self.detokenizer.final(seq)
                    text = full[sent:]
                else:
                    kept, shown = self.detokenizer.ready(seq)
                    text = self.detokenizer.state(seq).text[sent:shown]
            except Exception as exc:  # a tokenizer that cannot decode these ids: tokens only
                logger.warning("hf_paged: could not decode the tokens of %s: %s", seq.request_id, exc)
                kept, text = len(tokens), None
            new = tokens[seq.num_streamed : kept]
        if not new and not text and not final:
            return None
        return TokenDelta(seq.request_id, new, seq.finish_reason if final else None, text)

    def _hand_over_delta(self, seq: Sequence, delta: TokenDelta, from_outbox: bool = True) -> None:
        seq.num_streamed += len(delta.token_ids)
        if delta.text:
            self.detokenizer.state(seq).sent += len(delta.text)
        if from_outbox and delta.finished and seq in self.requests.outbox:
            self.requests.outbox.remove(seq)
            self.requests.untrack(seq)

    def _cancel(self, families: set[str]) -> None:
        """The reader of ``families`` is gone: stop those still running and drop their outputs. Inside a step of
        this thread (a stream closed by the garbage collector) it waits for the step's next consistent point."""
        self._to_cancel.append(set(families))
        if self._stepper != threading.get_ident():
            with self._interrupts.held(), self._lock:
                self._apply_cancels()

    def _apply_cancels(self) -> None:
        while self._to_cancel:
            families = self._to_cancel.pop()
            for rid in families:
                if self.requests.is_open(rid):
                    self.scheduler.abort(rid)
            self.requests.forget(families)
            self.scheduler.failed[:] = [s for s in self.scheduler.failed if family(s.request_id) not in families]

    def _advance(self) -> list[Sequence]:
        """Schedule and launch a step, then take in the tokens of the step before it (asynchronous scheduling:
        the host's bookkeeping runs while the device computes) or of this one (synchronous). Sequences that
        finish go to the outbox; returns those that got a token."""
        clock = self.counters.clock()
        self._collect_failed()
        batch = self.scheduler.schedule()
        self._collect_failed()
        clock("schedule")
        touched: list[Sequence] = []
        if not batch.is_empty and self._inflight is not None and any(
                s.pending_row >= 0 and s.params.repetition_penalty != 1.0 for s in batch.seqs):
            touched += self._resolve()  # the penalty reads the tokens themselves
            batch = _without_finished(batch)
        if not batch.is_empty:
            self.counters.note_step(self)
            try:
                launched = self._launch(batch)
            except BaseException as exc:
                # The batch did not run (its blocks stay reserved, its KV is rewritten when it runs): take in the
                # step before's tokens, which the failed launch may have overwritten on the device, and retry.
                touched += self._resolve()
                if not isinstance(exc, Exception):
                    raise
                touched += self._run_alone(_without_finished(batch), exc)
                return touched
            clock("forward")
            touched += self._resolve()
            clock("sample")
            self._commit(batch, launched)
        else:
            touched += self._resolve()
        if not self.async_scheduling:
            touched += self._resolve()
        clock("update")
        return touched

    def _run_alone(self, batch: ScheduledBatch, exc: Exception) -> list[Sequence]:
        """After a failed launch, run each sequence of ``batch`` alone (synchronously): one that fails again ends
        with ``finish_reason="error"`` (the fault is its own), the others go on as if nothing happened."""
        logger.warning("hf_paged: a step of %d sequences failed (%s: %s); running them one by one to find the "
                       "faulty ones", len(batch.seqs), type(exc).__name__, exc)
        touched = []
        for seq, n, smp in zip(batch.seqs, batch.num_tokens, batch.sample):
            if seq.is_finished:
                continue
            alone = ScheduledBatch([seq], [n], [smp])
            try:
                launched = self._launch(alone)
            except Exception as err:
                self._fail(seq, f"the model failed on this request: {type(err).__name__}: {err}")
                continue
            self._commit(alone, launched)
            touched += self._resolve()
        return touched

    def _collect_failed(self) -> None:
        """Move the scheduler's finished-outside-a-step sequences (errors, aborts) to the outbox."""
        failed = self.scheduler.failed
        if failed:
            self.requests.outbox += failed
            failed.clear()

    def _fail(self, seq: Sequence, error: str) -> None:
        self.scheduler.finish(seq, "error", error)
        self.requests.outbox.append(seq)

    def _launch(self, batch: ScheduledBatch) -> InFlightStep | None:
        """Forward and sample on the device; the sampled tokens start their copy to the host. Called with the lock
        held: what reads the sequences (the plan, or a graph's inputs) runs under it, the eager forward and the
        sampler without it, so other threads may add and abort requests meanwhile (an abort is applied when the
        step commits)."""
        sampled = [s for s, smp in zip(batch.seqs, batch.sample) if smp]
        size = self.graphs.size_for(batch.seqs, batch.num_tokens) if self.graphs is not None else None
        if size is None:
            plan = plan_step(batch.seqs, batch.num_tokens, batch.sample, self.block_manager.tables,
                             self.cache.block_size)
            with self._device_work():
                return self._sample(sampled, self.runner.forward(plan))
        with self._interrupts.allowed():
            logits = self.graphs.replay(batch.seqs, size)  # reads the sequences: under the lock
        if not all(batch.sample):
            rows = [i for i, smp in enumerate(batch.sample) if smp]
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        with self._device_work():
            return self._sample(sampled, logits[: len(sampled)])

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor) -> InFlightStep | None:
        if not sampled:
            return None
        tokens, logprobs = self.sampler(logits, SamplingBatch.build(sampled, logits.shape[-1], logits.device))
        self.runner.last_tokens[: len(sampled)].copy_(tokens, non_blocking=True)  # what the next step may read
        return self._receiver.send(sampled, tokens, logprobs)

    @contextmanager
    def _device_work(self) -> Iterator[None]:
        """Release the lock (and let Ctrl-C interrupt) for device work; the lock is taken back with Ctrl-C held."""
        self._lock.release()
        try:
            with self._interrupts.allowed():
                yield
        finally:
            self._lock.acquire()

    def _commit(self, batch: ScheduledBatch, launched: InFlightStep | None) -> None:
        """Record the step's KV as written and give its sampled sequences a placeholder for their new token;
        sequences that finished meanwhile (their step before was their last) are left out."""
        self.scheduler.commit(_without_finished(batch))
        if launched is not None:
            for row, seq in enumerate(launched.seqs):
                if not seq.is_finished:
                    seq.token_ids.append(PLACEHOLDER)
                    seq.pending_row = row
            self._inflight = launched

    def _resolve(self) -> list[Sequence]:
        """Write the in-flight step's tokens into its sequences and apply stop conditions (waiting for the copy
        if it has not landed); sequences that finish go to the outbox. Returns the sequences that got a token."""
        step = self._inflight
        if step is None:
            return []
        tokens, logprobs = step.wait()
        self._inflight = None
        got = []
        for seq, token, logprob in zip(step.seqs, tokens, logprobs):
            if seq.pending_row < 0 or seq.is_finished:  # aborted (or failed) while its token was in flight
                continue
            seq.token_ids[-1], seq.pending_row = token, -1
            self._take_token(seq, logprob)
            got.append(seq)
        return got

    def _take_token(self, seq: Sequence, logprob: float | None) -> None:
        """Bookkeeping of a sequence's newest token (already in ``token_ids``); a finished sequence goes to the
        outbox. A stop check that raises (the tokenizer, on stop strings) ends only this sequence, with an error."""
        if logprob is not None and seq.params.logprobs:
            seq.logprobs.append(logprob)
        self.counters.generated_tokens += 1
        if seq.num_generated == 1 and seq.pending_children:
            self._fork(seq)
        error = None
        try:
            reason = self.stop_checker.finish_reason(seq)
        except Exception as exc:
            reason, error = "error", f"the stop check failed on this request: {type(exc).__name__}: {exc}"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason, error = "error", validation.reached_position_limit(seq.num_prompt_tokens, self.max_model_len)
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

    def _output(self, seq: Sequence) -> RequestOutput:
        """The finished sequence's output: its tokens and text cut before a stop string that stopped it."""
        out, text = seq.output_token_ids, None
        if self.detokenizer is not None:
            try:
                kept, text = self.detokenizer.final(seq)
                out = out[:kept]
            except Exception as exc:  # a tokenizer that cannot decode these ids: tokens only
                logger.warning("hf_paged: could not decode the tokens of %s: %s", seq.request_id, exc)
        logprobs = list(seq.logprobs[: len(out)]) if seq.params.logprobs else None
        return RequestOutput(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], out, seq.finish_reason,
                             seq.error, logprobs, text)

    def _deltas(self, touched: list[Sequence], finished: list[Sequence]) -> list[TokenDelta]:
        deltas, final = [], set(map(id, finished))
        for seq in dict.fromkeys(touched + finished):
            delta = self._peek_delta(seq, id(seq) in final)
            if delta is not None:
                self._hand_over_delta(seq, delta, from_outbox=False)
                deltas.append(delta)
        return deltas


def _without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
    if len(keep) == len(batch.seqs):
        return batch
    return ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_tokens[i] for i in keep],
                          [batch.sample[i] for i in keep])


def _copy_index(out: RequestOutput) -> int:
    _, _, idx = out.request_id.partition(validation.CHILD_MARK)
    return int(idx) + 1 if idx else 0


def _engine_config(config: EngineConfig | None, **settings) -> EngineConfig:
    """``config``, or one built from the keyword settings; giving both (a keyword off its default) is refused."""
    if config is None:
        return EngineConfig(**settings)
    if not isinstance(config, EngineConfig):
        hint = ": pass EngineConfig(**settings)" if isinstance(config, dict) else ""
        raise ValueError(f"config must be an hf_paged.EngineConfig, got {type(config).__name__}{hint}")
    changed = [k for k, v in settings.items() if v != getattr(EngineConfig, k)]
    if changed:
        raise ValueError(f"give the engine settings either as config=EngineConfig(...) or as keywords, not both "
                         f"(got config and {', '.join(changed)})")
    return config


def _use_paged_attention(model: torch.nn.Module) -> None:
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        logger.info("hf_paged: switching the model's attention to %r for the engine", ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.training:
        logger.warning("hf_paged: the model is in training mode (dropout on); call model.eval() before generating")


def blocks_from_memory(config, block_size: int, dtype: torch.dtype, device, budget: float, cap: int) -> int:
    """Blocks that ``budget`` (a fraction of the free memory of ``device``) holds, at most ``cap``."""
    layout = KVLayout.from_config(config)
    return min(cap, blocks_for_budget(layout, block_size, dtype, [torch.device(device)] * layout.num_layers, budget))
