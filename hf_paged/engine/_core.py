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
import time
from collections.abc import Iterator
from itertools import compress
from contextlib import contextmanager
from dataclasses import replace

import torch

from hf_paged import _compat
from hf_paged.engine import _validation as validation
from hf_paged.cache._block_manager import BlockManager
from hf_paged.cache._block_table import BlockTableBuffer
from hf_paged.parallel import _fuse_all_reduce as fuse_all_reduce
from hf_paged.parallel import _linears as tp_linears
from hf_paged.parallel import _lockstep as lockstep
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.engine import _background_compile as background_compile
from hf_paged.engine import _sizing as sizing
from hf_paged.engine._config import EngineConfig
from hf_paged.engine._sizing import Workload
from hf_paged.runner._decode_graphs import engine_graphs
from hf_paged.engine._inflight import InFlightStep, TokenReceiver
from hf_paged.engine._interrupts import InterruptGuard
from hf_paged.engine._request_registry import RequestRegistry
from hf_paged.runner._model_runner import ModelRunner
from hf_paged.runner._step_plan import DecodeColumns, plan_step
from hf_paged.engine._prompt_logprobs import prompt_rows, score
from hf_paged.engine._sampler import Sampler, SamplingBatch, split_logprob_row
from hf_paged.engine._scheduler import ScheduledBatch, Scheduler
from hf_paged.engine._sequence import PLACEHOLDER, Sequence, SequenceStatus
from hf_paged.engine._stats import EngineStats
from hf_paged.engine._steady_decode import SteadyDecode
from hf_paged.engine._stop_checker import StopChecker
from hf_paged.engine._structured_output import StructuredOutput, advance as advance_grammar
from hf_paged.hf import _placement as placement
from hf_paged.parallel import _logits as tp_logits
from hf_paged.parallel._tensor_parallel import kv_layout
from hf_paged.hf._register import ATTN_IMPLEMENTATION, use_paged_attention
from hf_paged.hf._support import paged_kv

logger = logging.getLogger("hf_paged")
_status = operator.attrgetter("status")
_STATUS, _PENDING_ROW = _status, operator.attrgetter("pending_row")


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
    """The pool, the scheduler, the model runner and sampler of ``model``, and the step that drives them."""

    def __init__(self, model: torch.nn.Module, cfg: EngineConfig, tokenizer=None, workload: Workload | None = None):
        # the caller's attention, put back when the engine is done (Engine.close, the end of generate_batch)
        self.attention_before = _compat.attn_implementation(model.config)
        use_paged_attention(model)
        self.model, self.tokenizer = model, tokenizer
        self.device, dtype = model.device, model.dtype
        self.max_model_len = max_len = validation.position_limit(model.config)
        self.kv_devices = placement.kv_devices(model)  # each layer's KV next to its weights (a device_map split)
        # tensor parallel: the ranks step together
        self.lockstep, settings = lockstep.for_model(model, cfg.compile_layers, cfg.cuda_graphs)
        forced = {"cuda_graph_capture": "tensor parallel: every size at start, on every rank alike"} if (
            settings and cfg.cuda_graph_capture is None) else {}
        cfg = replace(cfg, **settings)
        # tensor parallel: each rank's model calls return its vocabulary columns
        self.vocab_shards = tp_logits.install(model, self.lockstep.tp) if self.lockstep is not None else None
        layout = kv_layout(model)  # the KV heads this process computes (its shard under tensor parallel)
        sized = sizing.size_engine(cfg, model.config, dtype, self.kv_devices, workload)
        cfg, reasons = sized.config, {**sized.reasons, **forced}
        num_blocks, why = sizing.pool_size(cfg, layout, dtype, self.kv_devices, max_len, workload)
        cfg = replace(cfg, num_blocks=num_blocks)
        if why is not None:
            reasons["num_blocks"] = why
        if self.lockstep is not None:  # every rank takes the same sizes (each read its own free memory)
            cfg = replace(cfg, num_blocks=self.lockstep.agree_min(cfg.num_blocks),
                          max_batch_tokens=self.lockstep.agree_min(cfg.max_batch_tokens),
                          max_num_seqs=self.lockstep.agree_min(cfg.max_num_seqs))
        self.config, self.sizing = cfg, reasons
        block_size, max_num_seqs = cfg.block_size, cfg.max_num_seqs
        self.pool, self.dispatcher = paged_kv(model.config, layout, self.kv_devices, dtype, block_size, cfg.num_blocks,
                                              cfg.kv_cache_dtype, cfg.backend)
        # Columns: a sequence's most blocks (the decode graphs' captured width; wider steps run eager), for a one-call
        # engine those of its workload's longest sequence (+1 token: a stopped sequence's step of lag), else of the
        # model's position limit; the host table and its pinned staging scale with it.
        longest = max_len if workload is None or not workload.one_call else min(
            max_len, max(workload.sequence_tokens, default=max_len) + 1)
        tables = BlockTableBuffer(max_num_seqs, min(cfg.num_blocks, -(-longest // block_size)))
        self.block_manager = BlockManager(self.pool.allocator, block_size, tables, self.pool.copy_blocks,
                                          cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_tokens, max_num_seqs)
        tp_compile = None if self.lockstep is None else fuse_all_reduce.layer_compile(self.lockstep.tp.group.group_name)
        self.compiled = background_compile.layers_for_engine(
            model, cfg.compile_layers, tp_compile,
            {name: getattr(cfg, name) for name in background_compile.HELPER_SETTINGS})
        self.skinny_linear = skinny_linear.for_engine(model, cfg.skinny_linear,
                                                      routed_elsewhere=tp_linears.installed(model))
        self.runner = ModelRunner(model, self.pool, self.dispatcher, cfg.max_batch_tokens, self.device,
                                  max_seqs=max_num_seqs,
                                  max_blocks_per_seq=tables.table.shape[1], compiled=self.compiled,
                                  skinny=self.skinny_linear, local_logits=self.vocab_shards is not None)
        if len(set(self.kv_devices)) > 1:
            # the sampled rows' indices go where the hidden states they index are, and accelerate's hook on the
            # model (which moves every tensor argument to the first device) leaves them there
            self.runner.output_device = placement.hidden_states_device(model)
            placement.keep_argument_in_place(model, "logits_to_keep")
        self.sampler = Sampler()
        self.structured = StructuredOutput(tokenizer, model.config.get_text_config(decoder=True).vocab_size)
        self.stop_checker = StopChecker(tokenizer)
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.counters = EngineStats()
        self.requests = RequestRegistry()
        auto = cfg.async_scheduling is None
        self.async_scheduling = self.device.type == "cuda" if auto else cfg.async_scheduling
        self._receiver = TokenReceiver(max_num_seqs, self.device)
        self._inflight: InFlightStep | None = None
        self._steady: SteadyDecode | None = None  # the decode step that may repeat (engine/_steady_decode.py)
        self._interrupts = InterruptGuard()
        self._lock = threading.Lock()  # the requests' state: held by a step except during its device work
        self.graphs = engine_graphs(self, cfg, tables, max_num_seqs)  # decode CUDA graphs, if any
        self.runner.compile_one_token = self.graphs is None  # (a one-token step is rare beside graphs: runner)
        # compile_layers="background" in an engine that serves many calls: once the helper process is done, the
        # layers switch to compiled ones between two steps (_take_compiled_layers); an engine of one call keeps its
        # eager layers (a switch inside a call would make its tokens depend on timing)
        self._helper = background_compile.helper(model) if (
            cfg.compile_layers == background_compile.BACKGROUND and self.compiled is None and workload is None) else None
        # The KV in the pool holds for the weights it was computed with: an in-place change of a parameter (an
        # optimizer step, load_state_dict) raises its version counter, which each step compares (_forget_kv).
        self._weights = list(model.parameters())
        self._weights_version = _compat.version_sum(self._weights)
        self._kv_stale = False  # reset_prefix_cache() asked for it
        if self.compiled is not None and self.compiled.artifacts is not None:
            self.compiled.artifacts.save()  # what the start compiled, for the next process
        logger.info("hf_paged: engine on %s: %s", self.device, sizing.describe(cfg, reasons, self.graphs is not None))

    def _advance(self) -> list[Sequence]:
        """Schedule and launch a step, then take in the tokens of the step before it (asynchronous scheduling:
        the host's bookkeeping runs while the device computes) or of this one (synchronous). Sequences that
        finish go to the outbox; returns those that got a token."""
        clock = self.counters.clock()
        touched: list[Sequence] = []
        if self._kv_stale or _compat.version_sum(self._weights) != self._weights_version:
            touched += self._forget_kv()
        if self._helper is not None and self._helper.state() != "running":
            touched += self._take_compiled_layers()
        self._collect_failed()
        steady = self._steady
        batch = steady.schedule(self.scheduler) if steady is not None else None
        if batch is None:
            steady = self._steady = None
            batch = self.scheduler.schedule()
        self._collect_failed()
        if self.lockstep is not None:
            self.lockstep.check(batch.seqs, batch.num_tokens)  # every rank scheduled this batch, or all raise
        clock("schedule")
        if steady is None and not batch.is_empty and self._inflight is not None and any(
                s.pending_row >= 0 and s.params.reads_own_tokens for s in batch.seqs):
            touched += self._resolve()  # a penalty or a grammar reads the tokens themselves
            batch = _without_finished(batch)
        if not batch.is_empty:
            self.counters.note_step(self)
            try:
                launched = self._launch(batch, steady)
            except BaseException as exc:
                self._steady = None
                if self.lockstep is not None and isinstance(exc, Exception):
                    self.lockstep.fail(exc)  # the ranks cannot rerun apart: all raise
                # The batch did not run (its blocks stay reserved, its KV is rewritten when it runs): take in the
                # step before's tokens, which the failed launch may have overwritten on the device, and retry.
                touched += self._resolve()
                if not isinstance(exc, Exception):
                    raise
                touched += self._run_alone(_without_finished(batch), exc)
                return touched
            clock("forward")
            if steady is not None and self._take_steady(steady, launched):
                touched += steady.seqs
                clock("update")
                return touched
            touched += self._resolve()
            clock("sample")
            self._commit(batch, launched)
        else:
            touched += self._resolve()
        if not self.async_scheduling:
            touched += self._resolve()
        self._steady = SteadyDecode.after(batch, self.scheduler, self.pool.block_size, self.max_model_len,
                                          self.async_scheduling)
        clock("update")
        return touched

    def _take_compiled_layers(self) -> list[Sequence]:
        """``compile_layers="background"``: the helper process ended; from the next step on the layers run compiled
        (from torch's caches) in decode graphs captured anew (the eager ones are freed), the in-flight step's tokens
        taken in first; if the helper failed they stay eager. Returns the sequences that got a token."""
        helper, self._helper = self._helper, None
        if helper.state() == "failed":  # compiling here would hold up the running requests for the whole compile
            helper.report("this engine keeps its layers eager; engines started later compile them at start")
            return []
        touched = self._resolve()
        self._steady = None
        layers = background_compile.layers_for_engine(self.model, self.config.compile_layers, None, {})
        if layers is None:
            return touched
        began = time.perf_counter()
        self._release_graphs()
        self.compiled = self.runner.compiled = layers
        self.graphs = engine_graphs(self, self.config, self.block_manager.tables, self.config.max_num_seqs)
        self.runner.compile_one_token = self.graphs is None
        if layers.artifacts is not None:
            layers.artifacts.save()
        logger.info("hf_paged: the engine's layers run compiled from now on (%.2f s to switch, CUDA graphs %s)",
                    time.perf_counter() - began, "captured anew" if self.graphs is not None else "off")
        return touched

    def _release_graphs(self) -> None:
        """Free the decode CUDA graphs now, once the device is done with any step that may still replay one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        graphs, self.graphs = self.graphs, None
        self.runner.compile_one_token = True  # decode of one sequence runs eager from now on
        if graphs is not None:
            graphs.release()

    def _forget_kv(self) -> list[Sequence]:
        """Drop every KV computed with the weights the model had before: the in-flight step's tokens are taken in
        (they were sampled already), every running sequence is queued to be computed afresh with its tokens so far,
        no prefix stays findable, and fp8 scales are fixed anew. Returns the sequences that got a token."""
        touched = self._resolve()
        self._steady = None
        self.scheduler.recompute_all()
        dropped = self.block_manager.reset_prefix_cache()
        self.pool.clear_scales()
        self._weights_version = _compat.version_sum(self._weights)
        self._kv_stale = False
        self.counters.kv_resets += 1
        logger.info("hf_paged: the KV computed so far is forgotten (%d cached blocks; the model's weights changed, "
                    "or reset_prefix_cache()); running requests are computed afresh", dropped)
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
                if not seq.is_finished:  # (an abort from another thread may land while it runs)
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

    def _launch(self, batch: ScheduledBatch, steady: SteadyDecode | None = None) -> InFlightStep | None:
        """Forward and sample on the device; the sampled tokens start their copy to the host. Called with the lock
        held: what reads the sequences (the plan, or a graph's inputs) runs under it, the eager forward and the
        sampler without it, so other threads may add and abort requests meanwhile (an abort is applied when the
        step commits). ``steady``: the step repeats a steady decode step, whose columns it keeps."""
        cols = steady.columns() if steady is not None else None
        sampled = batch.seqs if steady is not None else list(compress(batch.seqs, batch.sample))
        scored = prompt_rows(batch.seqs, batch.num_tokens) if steady is None else None
        size = None
        if self.graphs is not None and scored is None:
            longest = int(cols.positions.max()) if cols is not None else None
            size = self.graphs.size_for(batch.seqs, batch.num_tokens, longest)
        if size is None:
            if self.graphs is not None and self.block_manager.tables.num_changes > 4096:
                self.graphs.device_tables.sync()  # (while steps run eager, the graphs' table updates stay bounded)
            plan = plan_step(batch.seqs, batch.num_tokens, batch.sample, self.block_manager.tables,
                             self.pool.block_size, columns=cols, extra_rows=scored.rows if scored else None,
                             pad_logits=self.runner.pad_logits)
            with self._device_work():
                logits = self.runner.forward(plan)
                if scored is not None:
                    logits, extra = logits[: len(sampled)], logits[len(sampled) :]
                    scores = score(extra if self.vocab_shards is None else self.vocab_shards.gather(extra), scored)
                launched = self._sample(sampled, logits, steady)
            if scored is not None:
                for (seq, _), values in zip(scored.owners, scores):
                    seq.prompt_logprobs.extend(values)
            return launched
        if cols is None:
            cols = DecodeColumns.of(batch.seqs, batch.sample)
        with self._interrupts.allowed():
            logits = self.graphs.replay(batch.seqs, size, cols)  # reads the sequences: under the lock
        if not all(batch.sample):
            rows = [i for i, smp in enumerate(batch.sample) if smp]
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        with self._device_work():
            return self._sample(sampled, logits[: len(sampled)], steady)

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor,
                steady: SteadyDecode | None = None) -> InFlightStep | None:
        if not sampled:
            return None
        sampling = steady.sampling if steady is not None else None
        shards = self.vocab_shards
        if sampling is None:
            sampling = SamplingBatch.build(sampled, logits.shape[-1] if shards is None else shards.vocab,
                                           logits.device)
        if shards is None:
            (tokens, logprobs), agreed = self.sampler(logits, sampling), False
        else:
            tokens, logprobs, agreed = shards.sample(self.sampler, logits, sampling)
        if self.lockstep is not None and not agreed:
            self.lockstep.share(tokens, logprobs)  # the leading rank's tokens, so every rank feeds the same ids
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
        seqs = batch.seqs
        if (launched is not None and len(launched.seqs) == len(seqs) == batch.total_tokens
                and SequenceStatus.FINISHED not in map(_status, seqs)):
            self._commit_decode(seqs)  # (the usual decode step)
            self._inflight = launched
            return
        self.scheduler.commit(_without_finished(batch))
        if launched is not None:
            seqs = launched.seqs
            if SequenceStatus.FINISHED in map(_status, seqs):
                seqs = [s if s.status is not SequenceStatus.FINISHED else None for s in seqs]
            for row, seq in enumerate(seqs):
                if seq is not None:
                    seq.token_ids.append(PLACEHOLDER)
                    seq.pending_row = row
            self._inflight = launched

    def _commit_decode(self, seqs: list[Sequence]) -> None:
        """The commit of a step in which every sequence computed one token and sampled the next, in one pass."""
        bm = self.block_manager
        bs, register = bm.block_size, bm.register_full_blocks if bm.enable_prefix_caching else None
        for row, seq in enumerate(seqs):
            c = seq.num_computed_tokens = seq.num_computed_tokens + 1
            seq.token_ids.append(PLACEHOLDER)
            seq.pending_row = row
            if register is not None and c // bs > seq.num_hashed_blocks:
                register(seq)

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
            if logprob is not None and params.logprobs:
                logprob, top = split_logprob_row(logprob, params.top_logprobs)
                seq.logprobs.append(logprob)
                if params.top_logprobs:
                    seq.top_logprobs.append(top)
            if seq.pending_children and seq.num_generated == 1:
                self._fork(seq)
            error = None
            try:
                reason = finish_reason(seq)
                if seq.grammar is not None and reason is None:
                    reason, error = advance_grammar(seq.grammar, token, params.eos_token_ids)
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
            child.prompt_logprobs = list(parent.prompt_logprobs)
            if parent.params.json_schema is not None:
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


