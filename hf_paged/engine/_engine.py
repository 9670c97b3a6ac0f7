"""``Engine``: continuous batching over a paged KV pool, for any number of callers.

Requests join and leave the running batch every step (``EngineCore`` runs the steps). The engine checks requests
whole at the door (``validation``, ``SamplingParams``; several requests of one call are all checked before any is
queued, their shared generation config resolved once), keeps them in a ``RequestRegistry`` until their outputs are
handed over, and hands them to the right reader: ``step()`` takes every finished request, ``generate`` and
``stream(prompts)`` their own, which they abort when their caller stops. ``add_request`` and ``abort`` may come from
any thread, and from a signal's handler: the main thread takes the engine's lock only with signals' handlers held
back (``InterruptGuard``), so a handler never waits on a lock its own thread holds. ``close()`` (or
``with Engine(...) as engine:``) frees the decode CUDA graphs at a known point: they keep what they captured alive,
NCCL collectives included under tensor parallel, where ``torch.distributed.destroy_process_group()`` would otherwise
wait for them forever.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence as SequenceType
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from hf_paged.engine import _validation as validation
from hf_paged.engine._config import EngineConfig
from hf_paged.engine._core import EngineCore, restore_attention
from hf_paged.engine._request_output import RequestOutput, TokenDelta, delta_of, output_of
from hf_paged.engine._request_registry import family
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sizing import Workload
from hf_paged.engine._sequence import Sequence
from hf_paged._frozen_heap import frozen_heap

logger = logging.getLogger("hf_paged")
Prompt = SequenceType[int] | str


class Engine(EngineCore):
    """Continuous-batching generation for a decoder-only transformers model.

    Args:
        model: a causal LM; its attention is switched to ``"hf_paged"`` if it was loaded with another one, and back
            by :meth:`close` (the model's own ``generate`` meanwhile runs the paged attention's dense path).
        num_blocks: KV blocks in the pool; None sizes the pool from free device memory (``memory_budget``), at most
            what ``max_num_seqs`` sequences of the model's full length (or the ``workload``) use.
        block_size: tokens per block.
        max_batch_tokens: token budget of one step (prefill chunks and decodes together); None picks it from the
            device and its free memory (16384 on CUDA, 2048 elsewhere, less where a step would not fit the memory the
            KV pool leaves; ``hf_paged/engine/_sizing.py``).
        max_num_seqs: most sequences running at once; None picks it from the device and its free memory too (256,
            or the ``workload``'s sequences when fewer).
        tokenizer: needed for string prompts, stop strings and ``text`` in outputs.
        generation_config: default settings of requests added without one (default: the model's).
        enable_prefix_caching: reuse the KV of full blocks whose prefix was computed before.
        backend: restrict attention to these backends, in order (``hf_paged.available_backends()``).
        memory_budget: with ``num_blocks=None``, the fraction of free device memory the pool may take; None: 0.8 of
            it, and on a CPU at most 3% of the machine's RAM (which everything on the machine shares).
        cuda_graphs: on a CUDA device, capture decode steps as CUDA graphs (one per padded batch size,
            ``graph_batch_sizes(max_num_seqs)``: 2 rows and up, or the sizes given up to the first that holds
            ``max_num_seqs``; when: ``cuda_graph_capture``) and replay them;
            False runs every step eager.
            Graphs are switched off, with a log line saying why, when a backend serving decode is not capture-safe.
        cuda_graph_capture: when the graphs are captured: ``"start"`` (every size at engine start);
            ``"on_demand"``: the largest size at the first step a graph can serve (host work while the device runs
            the steps queued before it: for a call's engine, its prompts'), each smaller one once 32 decode steps
            would have used it (``hf_paged.runner._graph_sizes.ON_DEMAND_STEPS``), until then padding up to a
            larger graph; what ``generate_batch`` does for the engine of one call, which few steps of each small
            size do not pay back;
            ``"first_use"``: the smallest and the largest size at start, each other one at the first step that would
            use it. None (automatic): ``"on_demand"`` for an engine built for one call (a ``workload``), else
            ``"first_use"`` (a server's start then costs two captures, not one per size).
        async_scheduling: launch each step before taking in the tokens of the one before, so the host schedules
            while the device computes (one step of lag: a sequence that stops computes one token more, which is
            dropped). None: on for CUDA devices, off on the CPU (where nothing runs in parallel).
        compile_layers: run the model's work outside attention (norms, rotary, MLP, residual adds) compiled with
            ``torch.compile`` (fused kernels; the paged KV write and attention stay as they are), in eager and
            graph-captured steps alike. None: off where the layer kernels serve the model (``layer_kernels``: as
            fast, with no compile), else on for CUDA models where triton is installed; True also compiles on the
            CPU; False keeps the eager modules. Compiling takes tens of seconds once per model and process; a
            compiler failure switches back to the eager modules with a warning. Only the engine's own model calls
            use the compiled code.
        skinny_linear: serve the linear layers of decode steps of up to 8 sequences with hf_paged's skinny GEMM
            kernel (weight-bandwidth bound products; fp32 accumulation on tensor cores) instead of cuBLAS. None: on
            for CUDA models in float16/bfloat16 where the kernels build; False keeps cuBLAS everywhere. Only the
            engine's own model calls use it.
        layer_kernels: where the layers run eagerly (not compiled), run their RMSNorms, SiLU MLPs, q/k/v products and
            rotary embedding on hf_paged's layer kernels (one launch each instead of several per module), for the
            modules that compute what Llama's do (``hf_paged/compile/_layer_kernels.py``). None: on a model on one
            CUDA device, not tensor parallel, where the kernels build and route its norms, MLPs and rotary
            embedding; True: wherever they route anything (else an error saying why); False: never. Only the
            engine's own model calls use them.
        kv_cache_dtype: what the KV pool stores: None or ``"auto"``, the model's dtype; ``"fp8"`` (``"fp8_e4m3"``),
            e4m3 with per-head scales, twice the blocks in the same memory; decode, prefill and the KV write on the
            cuda kernels (CUDA graphs included) for float16/bfloat16 models at their e4m3 head sizes; see
            ``PagedAttentionCache`` and ``docs/guides/cache.md``.
        logprobs_mode: what the logprobs of sampled tokens (``output_logprobs``) are of: ``"raw_logprobs"`` (the
            model's logits) or ``"processed_logprobs"`` (the distribution the token was drawn from: after the
            penalties, temperature, top-k, top-p and min-p, renormalized).
        config: the settings above as one :class:`EngineConfig` instead of keywords (not both).
        workload: what the engine will run, when it is built for known prompts (``generate_batch`` passes its
            call's): the automatic sizes fit it (``hf_paged.engine.Workload``: each sequence's most tokens).

    ``stats()["sizing"]`` and the engine's start-up log line (logger ``"hf_paged"``, INFO) say which sizes were
    automatic and why; ``config`` holds the sizes picked.

    Threads: ``add_request``, ``abort``, ``abort_all``, ``reset_prefix_cache``, ``has_unfinished`` and ``stats`` may be
    called from any thread while one thread runs ``step``, ``stream`` or ``generate``, and from a signal's handler
    (which Python runs in the main thread, maybe in the middle of a step): they take effect at once (an abort's
    output comes from the next step) and ``stats`` says where the engine stands. A handler that raises (Ctrl-C)
    while ``step`` hands its outputs over does not lose them: the next ``step`` returns them.

    Weights: the KV computed so far belongs to the model's weights at the time. Each step compares the parameters'
    version counters with those the KV was computed under; an in-place change (an optimizer step,
    ``load_state_dict``) makes the engine forget that KV (prefix cache included) and compute running requests afresh.
    After other changes, call :meth:`reset_prefix_cache`.

    Closing: :meth:`close` (or ``with Engine(...) as engine:``) frees the decode CUDA graphs at once; do it before
    ``torch.distributed.destroy_process_group()`` under tensor parallel, which waits for collectives a live graph
    holds.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int | None = EngineConfig.num_blocks,
        block_size: int = EngineConfig.block_size,
        max_batch_tokens: int | None = EngineConfig.max_batch_tokens,
        max_num_seqs: int | None = EngineConfig.max_num_seqs,
        tokenizer=None,
        generation_config: GenerationConfig | None = None,
        enable_prefix_caching: bool = EngineConfig.enable_prefix_caching,
        backend: str | SequenceType[str] | None = EngineConfig.backend,
        memory_budget: float | None = EngineConfig.memory_budget,
        cuda_graphs: bool | SequenceType[int] = EngineConfig.cuda_graphs,
        async_scheduling: bool | None = EngineConfig.async_scheduling,
        compile_layers: bool | str | None = EngineConfig.compile_layers,
        skinny_linear: bool | None = EngineConfig.skinny_linear,
        config: EngineConfig | None = None,
        kv_cache_dtype: str | None = EngineConfig.kv_cache_dtype,
        cuda_graph_capture: str | None = EngineConfig.cuda_graph_capture,
        logprobs_mode: str = EngineConfig.logprobs_mode,
        layer_kernels: bool | None = EngineConfig.layer_kernels,
        *,
        workload: Workload | None = None,
    ):
        given = locals()  # (the keywords of the settings are the EngineConfig fields)
        cfg = EngineConfig.resolve(config, **{name: given[name] for name in EngineConfig.field_names()})
        generation_config = validation.generation_config(generation_config)
        super().__init__(model, cfg, tokenizer, workload)
        self.generation_config = generation_config or getattr(model, "generation_config", None) or GenerationConfig()
        self._closed = False
        self._stepper: int | None = None  # the thread inside a step (None: no step runs)
        self._to_cancel: list[set[str]] = []  # families whose reader left during a step of its own thread
        # what _step took out for its caller when a signal's handler raised before it returned: (finished sequences,
        # deltas), put back by the next call (_put_back)
        self._undelivered: list[tuple[list[Sequence], list[TokenDelta]]] = []

    # ----- requests -------------------------------------------------------------------------------------------

    def add_request(
        self, prompt: Prompt, generation_config: GenerationConfig | None = None, request_id: str | int | None = None
    ) -> str:
        """Queue a prompt (token ids, or a string with a tokenizer); returns its request id.

        Raises ``ValueError`` (one line naming the field, nothing queued) for anything the engine cannot serve: an
        empty prompt, text that is not well-formed (a lone surrogate) or that the tokenizer refuses, token ids that
        are not integers of the vocabulary, invalid or unserved sampling settings, a duplicate live
        ``request_id``. A prompt that can never run (longer than the whole cache, or leaving no room within the
        model's position limit) finishes with ``finish_reason="error"`` and a message instead.
        """
        return self._enqueue([self._new_sequence(prompt, generation_config, request_id, {})])[0]

    def add_requests(
        self, prompts: list[Prompt], generation_config: GenerationConfig | list[GenerationConfig] | None = None,
        request_ids: list[str | int] | None = None,
    ) -> list[str]:
        """Queue several prompts (one config for all, or one each); returns their request ids, in order.

        Every prompt is checked before any is queued: a ``ValueError`` (as :meth:`add_request` raises it) queues
        nothing. A config shared by the prompts is resolved once, which makes this cheaper than a loop of
        ``add_request`` for many prompts.
        """
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request ids for {len(prompts)} prompts; give one each or none")
        return self._enqueue(self._new_sequences(prompts, generation_config, "add_requests", request_ids))

    def _new_sequence(self, prompt: Prompt, config: GenerationConfig | None, request_id,
                      resolved: dict[int, GenerationConfig], field: str = "prompt", checked: bool = False) -> Sequence:
        """Validate a request and build its sequence (id and arrival are given when it is queued); changes
        nothing in the engine. ``resolved`` memoizes resolved configs by identity for the prompts of one call;
        ``field`` names the prompt in errors; ``checked``: ``prompt`` is already what ``prompt_token_ids`` returns
        for it."""
        ids = prompt if checked else validation.prompt_token_ids(prompt, self.vocab_size, self.tokenizer, field)
        config = validation.generation_config(config) or self.generation_config
        if id(config) not in resolved:
            resolved[id(config)] = SamplingParams.resolve(config, getattr(self.model, "generation_config", None))
        params = SamplingParams.from_resolved(resolved[id(config)], len(ids))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: create the Engine with tokenizer=...")
        seed = params.seed if params.seed is not None else int(torch.randint(2**31 - 1, ()).item())
        seq = Sequence(validation.request_id(request_id), ids, params, (0, 0), seed, params.num_return_sequences - 1)
        # (a schema is compiled here: one that cannot be is refused at the door)
        seq.grammar = self.structured.matcher(params.json_schema)
        return seq

    def _enqueue(self, seqs: list[Sequence]) -> list[str]:
        """Give each sequence its id and arrival, and queue it (or fail it at once if it can never run)."""
        with self._locked():
            self._refuse_if_closed()
            self._put_back()  # (the id of an output not delivered yet is still live)
            given = Counter(s.request_id for s in seqs if s.request_id is not None)
            clash = next((rid for rid, n in given.items() if n > 1 or rid in self.requests.open), None)
            if clash is not None:  # before any is queued
                raise ValueError(f"request id {clash!r} is already live or given twice; pick another")
            for seq in seqs:
                seq.request_id, arrival = self.requests.new_id(seq.request_id)
                seq.arrival = (arrival, 0)
                self.requests.track(seq)
                self.counters.prompt_tokens += seq.num_tokens
                self.scheduler.add(seq, self._never_runs(seq))
            return [seq.request_id for seq in seqs]

    def _never_runs(self, seq: Sequence) -> str | None:
        bs, num_blocks = self.config.block_size, self.config.num_blocks
        if seq.num_tokens >= self.max_model_len:
            return (f"the prompt ({seq.num_tokens} tokens) leaves no room for a new token within the model's position "
                    f"limit ({self.max_model_len} tokens, max_position_embeddings); shorten the prompt")
        if -(-seq.num_tokens // bs) > num_blocks:
            return (f"the prompt ({seq.num_tokens} tokens) is longer than the whole KV cache ({num_blocks} blocks "
                    f"of {bs}); create the Engine with more num_blocks")
        return None

    def _new_sequences(self, prompts, config, what: str, request_ids: list | None = None,
                       checked: bool = False) -> list[Sequence]:
        """Validate every prompt (and its config) before any is queued; a config shared by several prompts is
        resolved once (the configs do not change during the call). ``checked``: the prompts are lists of token ids
        that ``validation.prompt_token_ids`` returned (``generate_batch`` checks them before it builds the engine)."""
        prompts = validation.prompt_list(prompts, what)
        configs = validation.generation_configs(config, len(prompts))
        resolved: dict[int, GenerationConfig] = {}
        return [self._new_sequence(p, c, rid, resolved, f"prompts[{i}]", checked)
                for i, (p, c, rid) in enumerate(zip(prompts, configs, request_ids or [None] * len(prompts)))]

    def abort(self, request_id: str | int) -> None:
        """Stop a request (and its copies); its output, with ``finish_reason="abort"``, comes from the next step.
        An id that is not live (unknown, or finished already) is ignored."""
        if request_id is None:
            raise ValueError("abort takes the request_id given to add_request (a string or an integer), got None; "
                             "abort_all() stops every request")
        rid = validation.request_id(request_id)
        with self._locked():
            self.scheduler.abort(rid)

    def abort_all(self) -> list[str]:
        """Abort every live request (as :meth:`abort` does); returns the ids of the sequences stopped."""
        stopped = []
        with self._locked():
            for rid in dict.fromkeys(family(s.request_id) for s in self.scheduler.live):
                stopped += self.scheduler.abort(rid)
        return [s.request_id for s in stopped]

    def reset_prefix_cache(self) -> None:
        """Forget every KV the engine has computed: no cached prefix is reused, and running requests are computed
        afresh (their tokens so far kept) before their next token. Call it after changing the model's weights in a
        way that leaves the parameters' version counters alone: a write through ``param.data``, parameters or buffers
        replaced. Changes in place (an optimizer step, ``load_state_dict``, ``param.copy_(...)``) are found at the next
        step without it. Any thread; while a step runs elsewhere, it takes effect at the next step."""
        self.weights.stale = True
        with self._locked():
            if self._stepper is None and not self._closed:
                self._forget_kv()

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this engine runs: one token short of the model's position limit, and within the whole
        KV cache (a longer one ends at once with ``finish_reason="error"``)."""
        return min(self.max_model_len - 1, self.config.num_blocks * self.config.block_size)

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, in flight, or finished but not handed over yet."""
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self.requests.outbox)
                or bool(self._undelivered))

    # ----- running ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that finished (under asynchronous scheduling: whose last
        token arrived) during it, and of requests that failed or were aborted since the step before."""
        return self._step(want_deltas=False)[0]

    def step_with_deltas(self) -> tuple[list[RequestOutput], list[TokenDelta]]:
        """Like :meth:`step`, and also every request's new tokens (and text) since the last hand-over: what a
        server loop that streams many requests needs from one step."""
        return self._step(want_deltas=True)

    def stream(
        self,
        prompts: list[Prompt] | None = None,
        generation_config: GenerationConfig | list[GenerationConfig] | None = None,
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
            while any(map(self.requests.is_open, owned)) if owned is not None else self.has_unfinished():
                with self._stepping():
                    touched = self._advance()
                    # the sequences that got tokens, then the finished ones, each with whether it is finished
                    ready = [(s, s in self.requests.outbox) for s in dict.fromkeys(touched + self.requests.outbox)
                             if owned is None or family(s.request_id) in owned]
                for seq, final in ready:
                    with self._locked():
                        delta = delta_of(seq, self.detokenizer, final)
                    if delta is None:
                        continue
                    try:
                        yield delta
                    finally:  # runs once the consumer has the delta, whether it goes on or closes the stream
                        with self._locked():
                            self._hand_over_delta(seq, delta)
        finally:
            if owned:
                self._cancel(owned)

    @frozen_heap()  # the whole call (hf_paged/_frozen_heap.py)
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
        try:
            with tqdm(total=len(ids), disable=not progress_bar, unit="request") as bar:
                while any(map(self.requests.is_open, owned)):
                    outs = self._step(want_deltas=False, owned=owned)[0]
                    done += outs
                    bar.update(sum(not self.requests.is_open(rid) for rid in {family(o.request_id) for o in outs}))
        except BaseException:
            self._cancel(owned)
            raise
        place = {rid: i for i, rid in enumerate(ids)}
        return sorted(done, key=lambda out: (place[family(out.request_id)], _copy_index(out)))

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests and debugging): block reference counts match the live
        sequences' tables, free + used blocks make the pool, every live or finished sequence has an open request."""
        with self._locked():
            self.scheduler.check_invariants()
            alloc = self.block_manager.allocator
            assert alloc.num_free + alloc.num_used == alloc.num_blocks
            held = self.scheduler.live + self.scheduler.failed + self.requests.outbox
            assert all(self.requests.open.get(s.request_id) is s for s in held), "a sequence without its request"
            assert all(s.is_finished for s in self.requests.outbox + self.scheduler.failed)

    def stats(self) -> dict:
        """Blocks, preemptions, prefix-cache hits, token counts and which attention backend served each phase."""
        with self._locked():
            bm, sched, cfg = self.block_manager, self.scheduler, self.config
            return {**self.runner.stats(), **self.counters.counts(), "cached_blocks": bm.num_cached_blocks,
                    "preemptions": sched.num_preemptions, "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
                    "running": len(sched.running), "waiting": len(sched.waiting),
                    "max_batch_tokens": cfg.max_batch_tokens, "max_num_seqs": cfg.max_num_seqs,
                    "sizing": dict(self.sizing)}  # the automatic settings, each with why it was picked

    # ----- closing --------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Abort every unfinished request (their outputs are dropped), wait for the device's work, and free the
        decode CUDA graphs now, and switch the model back to the attention it ran before the engine. Later
        ``add_request``, ``step``, ``stream`` and ``generate`` calls raise ``RuntimeError``; ``stats()`` still
        answers. The KV pool is freed with the engine object. Call it from the thread that steps (or when no step
        runs); a second call does nothing. Under tensor parallel every rank closes its own engine (no collective
        runs)."""
        if self._closed:
            return
        self.abort_all()  # (takes the engine's lock itself)
        with self._stepping():
            self.runner.release_graphs()  # (an in-flight step may still replay a graph)
            self._inflight = None
            self._closed = True
        restore_attention(self.model, self.attention_before)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception as err:  # the block's own error goes on; a failure to close (a broken device) is only logged
            if exc_type is None:
                raise
            logger.warning("hf_paged: closing the engine after %s failed too (%s: %s)", exc_type.__name__,
                           type(err).__name__, err)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed (Engine.close()); create a new Engine to generate again")

    # ----- internals -------------------------------------------------------------------------------------------
    def _step(self, want_deltas: bool, owned: set[str] | None = None) -> tuple[list[RequestOutput], list[TokenDelta]]:
        """One step, then hand over the finished requests of ``owned`` (None: all) waiting in the outbox, and the
        new tokens of the rest when ``want_deltas``.

        A signal's handler that raises (Ctrl-C) during the step does so once the state is consistent and the lock
        released, which is after the outputs were taken out; they then wait in ``_undelivered`` for the next call.
        Python runs handlers at a function's start, after a call into C returns and at a loop's jump back: none runs
        from the ``except`` to the ``append``, nor from this function's return to its caller's assignment, so what
        was taken out either reaches the caller or goes back."""
        handed = None
        try:
            with self._stepping():
                touched = self._advance()
                self._apply_cancels()
                clock = self.counters.clock()
                finished = self.requests.take(owned)
                deltas = self._deltas(touched, finished) if want_deltas else []
                handed = finished, deltas
                outputs = [output_of(s, self.detokenizer) for s in finished]
                clock("update")
        except BaseException:
            if handed is not None:
                self._undelivered.append(handed)
            raise
        return outputs, deltas

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the engine's lock, with signals' handlers held back in the main thread until it is released."""
        with self._interrupts.held(), self._lock:
            yield

    @contextmanager
    def _stepping(self) -> Iterator[None]:
        """Hold the lock (Ctrl-C held back) for a step; steps come from one thread at a time."""
        with self._locked():
            self._refuse_if_closed()
            if self._stepper is not None:
                raise RuntimeError("a step is running in another thread: step(), stream() and generate() must be "
                                   "called from one thread at a time (add_request and abort from any)")
            self._stepper = threading.get_ident()
            try:
                self._apply_cancels()
                yield
                self._apply_cancels()
            finally:
                self._stepper = None

    def _hand_over_delta(self, seq: Sequence, delta: TokenDelta) -> None:
        """Record ``delta`` as handed to its reader; a request's last delta closes it."""
        seq.num_streamed += len(delta.token_ids)
        seq.text_state.sent += len(delta.text or "")  # (None without a tokenizer)
        if delta.finished and seq in self.requests.outbox:
            self.requests.outbox.remove(seq)
            self.requests.untrack(seq)

    def _cancel(self, families: set[str]) -> None:
        """The reader of ``families`` is gone: stop those still running and drop their outputs. Inside a step of
        this thread (a stream closed by the garbage collector) it waits for the step's next consistent point."""
        with self._interrupts.held():  # (a second Ctrl-C must not leave the requests running)
            self._to_cancel.append(set(families))
            if self._stepper != threading.get_ident():
                with self._lock:
                    self._apply_cancels()

    def _put_back(self) -> None:
        """Return what interrupted hand-overs took out (``_undelivered``) to the outbox and the streams' counts,
        as if it had not been taken."""
        while self._undelivered:
            finished, deltas = self._undelivered.pop()
            self.requests.put_back(finished)
            for delta in deltas:
                if (seq := self.requests.open.get(delta.request_id)) is not None:
                    seq.num_streamed -= len(delta.token_ids)
                    seq.text_state.sent -= len(delta.text or "")

    def _apply_cancels(self) -> None:
        self._put_back()  # (before a reader's requests are dropped: the outputs taken out for it go too)
        while self._to_cancel:
            families = self._to_cancel.pop()
            for rid in families:
                if self.requests.is_open(rid):
                    self.scheduler.abort(rid)
            self.requests.forget(families)
            self.scheduler.discard_failed(families)

    def _deltas(self, touched: list[Sequence], finished: list[Sequence]) -> list[TokenDelta]:
        deltas, final = [], set(map(id, finished))
        for seq in dict.fromkeys(touched + finished):
            if (delta := delta_of(seq, self.detokenizer, id(seq) in final)) is not None:
                self._hand_over_delta(seq, delta)
                deltas.append(delta)
        return deltas


def _copy_index(out: RequestOutput) -> int:
    _, _, idx = out.request_id.partition(validation.CHILD_MARK)
    return int(idx) + 1 if idx else 0
