"""``Engine``: continuous batching over a :class:`~hf_paged.PagedAttentionCache`.

Requests join and leave the running batch every step; each step schedules (``Scheduler``), plans flat tensors
(``plan_step``), runs the model once over all scheduled tokens packed in one row (``ModelRunner``), samples on the
device (``Sampler``) and copies the new tokens back in one transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence as SequenceType
from dataclasses import replace

import torch
from transformers import GenerationConfig

from hf_paged.cache.kv_pool import KVLayout, blocks_for_budget
from hf_paged.cache.paged_cache import PagedAttentionCache
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.block_table_buffer import BlockTableBuffer
from hf_paged.engine.config import EngineConfig
from hf_paged.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from hf_paged.engine.request_output import RequestOutput, TokenDelta
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
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.counters = EngineStats()
        self._live: dict[str, Sequence] = {}
        self._next_id = 0
        auto = cfg.async_scheduling is None
        self.async_scheduling = self.device.type == "cuda" if auto else cfg.async_scheduling
        self._receiver = TokenReceiver(max_num_seqs, self.device)
        self._inflight: InFlightStep | None = None
        self._outbox: list[Sequence] = []  # finished sequences not handed over yet
        self._interrupts = InterruptGuard()
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
        self, prompt: Prompt, generation_config: GenerationConfig | None = None, request_id: str | None = None
    ) -> str:
        """Queue a prompt (token ids, or a string with a tokenizer); returns its request id.

        Raises ``ValueError`` for an empty prompt, token ids outside the vocabulary, invalid sampling values or a
        duplicate live ``request_id``. A prompt longer than the whole cache finishes with ``finish_reason="error"``.
        """
        return self._enqueue(self._new_sequence(prompt, generation_config, request_id))

    def _new_sequence(
        self, prompt: Prompt, config: GenerationConfig | None, request_id: str | None, position: int = 0
    ) -> Sequence:
        """Validate a request and build its sequence, ``position`` places after the next in the queue; changes
        nothing in the engine."""
        ids = validation.prompt_token_ids(prompt, self.vocab_size, self.tokenizer)
        params = SamplingParams.from_generation_config(
            validation.generation_config(config) or self.generation_config, len(ids),
            getattr(self.model, "generation_config", None))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: create the Engine with tokenizer=...")
        arrival = self._next_id + position
        rid = validation.request_id(request_id) or str(arrival)
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already live; pick another")
        seed = params.seed if params.seed is not None else int(torch.randint(2**31 - 1, ()).item())
        return Sequence(rid, ids, params, (arrival, 0), seed, params.num_return_sequences - 1)

    def _enqueue(self, seq: Sequence) -> str:
        self._next_id = seq.arrival[0] + 1
        self._live[seq.request_id] = seq
        self.counters.prompt_tokens += seq.num_tokens
        bs, num_blocks = self.cache.block_size, self.cache.num_blocks
        if seq.num_tokens >= self.max_model_len:
            seq.finish("error", validation.past_position_limit(seq.num_tokens, self.max_model_len))
            self.scheduler.failed.append(seq)
        elif -(-seq.num_tokens // bs) > num_blocks:
            seq.finish("error", f"the prompt ({seq.num_tokens} tokens) is longer than the whole KV cache "
                                f"({num_blocks} blocks of {bs}); create the Engine with more num_blocks")
            self.scheduler.failed.append(seq)
        else:
            self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str | int) -> None:
        """Stop a request (and its copies); its output, with ``finish_reason="abort"``, comes from the next step.
        An id that is not live (unknown, or finished already) is ignored."""
        self.scheduler.failed.extend(self.scheduler.abort(validation.request_id(request_id)))

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, in flight, or finished but not handed over yet."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._outbox)

    # ----- running ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that finished during it."""
        return self._step(want_deltas=False)[0]

    def stream(
        self, prompts: list[Prompt] | None = None, generation_config: GenerationConfig | None = None
    ) -> Iterator[TokenDelta]:
        """Add ``prompts`` (if any) and step until nothing is left, yielding each request's new tokens per step."""
        for p in prompts or []:
            self.add_request(p, generation_config)
        while self.has_unfinished():
            yield from self._step(want_deltas=True)[1]

    def generate(
        self,
        prompts: list[Prompt],
        generation_config: GenerationConfig | list[GenerationConfig] | None = None,
        progress_bar: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (one config for all, or one per prompt); outputs in prompt order, a prompt's
        ``num_return_sequences`` copies together. Every prompt is checked before any is queued."""
        if self.has_unfinished():
            raise RuntimeError("generate runs its own batch: finish or abort the requests added with add_request first")
        prompts = validation.prompt_list(prompts)
        configs = validation.generation_configs(generation_config, len(prompts))
        seqs = [self._new_sequence(p, c, None, position=i) for i, (p, c) in enumerate(zip(prompts, configs))]
        ids = [self._enqueue(seq) for seq in seqs]
        wanted, done = set(ids), {}
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), disable=not progress_bar, unit="request") as bar:
            while self.has_unfinished():
                for out in self.step():
                    done[out.request_id] = out
                    bar.update(out.request_id in wanted)
        by_request: dict[str, list[RequestOutput]] = {}
        for out in done.values():
            by_request.setdefault(out.request_id.partition("__child#")[0], []).append(out)
        return [o for rid in ids for o in sorted(by_request[rid], key=_copy_index)]

    def stats(self) -> dict:
        """Blocks, preemptions, prefix-cache hits, token counts and which attention backend served each phase."""
        return self.counters.snapshot(self)

    # ----- internals -------------------------------------------------------------------------------------------
    def _step(self, want_deltas: bool) -> tuple[list[RequestOutput], list[TokenDelta]]:
        """One step, then hand over every finished request waiting in the outbox (and the new tokens of the rest
        when ``want_deltas``). A Ctrl-C during the step is raised once the state is consistent, before anything
        is handed over: the outbox then waits for the next call."""
        with self._interrupts.held():
            touched = self._advance()
            self._interrupts.raise_pending()
            clock = self.counters.clock()
            finished = list(self._outbox)
            outputs = [self._output(s) for s in finished]
            deltas = self._deltas(touched, finished) if want_deltas else []
            del self._outbox[: len(finished)]
            for seq in finished:
                self._live.pop(seq.request_id, None)
            clock("update")
        return outputs, deltas

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
                with self._interrupts.allowed():
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
                with self._interrupts.allowed():
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
            self._outbox += failed
            failed.clear()

    def _fail(self, seq: Sequence, error: str) -> None:
        self.scheduler.finish(seq, "error", error)
        self._outbox.append(seq)

    def _launch(self, batch: ScheduledBatch) -> InFlightStep | None:
        """Forward and sample on the device; the sampled tokens start their copy to the host."""
        logits = self._forward(batch)
        sampled = [s for s, smp in zip(batch.seqs, batch.sample) if smp]
        if not sampled:
            return None
        tokens, logprobs = self.sampler(logits, SamplingBatch.build(sampled, logits.shape[-1], logits.device))
        self.runner.last_tokens[: len(sampled)].copy_(tokens, non_blocking=True)  # what the next step may read
        return self._receiver.send(sampled, tokens, logprobs)

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

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The logits of the step's sampled rows: a captured graph for a decode step it fits, else eager."""
        size = self.graphs.size_for(batch.seqs, batch.num_tokens) if self.graphs is not None else None
        if size is None:
            plan = plan_step(batch.seqs, batch.num_tokens, batch.sample, self.block_manager.tables,
                             self.cache.block_size)
            return self.runner.forward(plan)
        logits = self.graphs.replay(batch.seqs, size)
        if all(batch.sample):
            return logits[: len(batch.seqs)]
        rows = [i for i, smp in enumerate(batch.sample) if smp]
        return logits.index_select(0, torch.tensor(rows, device=logits.device))

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
            self._outbox.append(seq)

    def _fork(self, parent: Sequence) -> None:
        """Start the copies of ``num_return_sequences``: they share the prompt's blocks and recompute only its last
        token (into a private copy of the shared tail block) to draw their own first token."""
        n, parent.pending_children = parent.pending_children, 0
        prompt = parent.token_ids[: parent.num_prompt_tokens]
        for i in range(n):
            child = Sequence(f"{parent.request_id}__child#{i}", prompt, parent.params, (parent.arrival[0], i + 1),
                             (parent.seed * 1_000_003 + i + 1) % 2**62)
            self._live[child.request_id] = child
            sched = self.scheduler
            room = len(sched.running) < sched.max_num_seqs and self.block_manager.tables.num_free_rows
            if room and parent.status is SequenceStatus.RUNNING:  # (preempted meanwhile: nothing to share)
                self.block_manager.fork(parent, child, len(prompt) - 1)
                sched.insert_running(child)
            else:
                sched.enqueue(child)

    def _output(self, seq: Sequence) -> RequestOutput:
        out = seq.output_token_ids
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return RequestOutput(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], out, seq.finish_reason,
                             seq.error, list(seq.logprobs) if seq.params.logprobs else None, text)

    def _deltas(self, touched: list[Sequence], finished: list[Sequence]) -> list[TokenDelta]:
        deltas, seen = [], set()
        for seq in touched + finished:
            if id(seq) in seen:
                continue
            seen.add(id(seq))
            new = seq.output_token_ids[seq.num_streamed :]
            seq.num_streamed += len(new)
            text = self.tokenizer.decode(new) if self.tokenizer is not None and new else None
            deltas.append(TokenDelta(seq.request_id, new, seq.finish_reason, text))
        return deltas


def _without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
    if len(keep) == len(batch.seqs):
        return batch
    return ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_tokens[i] for i in keep],
                          [batch.sample[i] for i in keep])


def _copy_index(out: RequestOutput) -> int:
    _, _, idx = out.request_id.partition("__child#")
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
