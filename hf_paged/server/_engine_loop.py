"""``EngineLoop``: the one thread that owns the :class:`~hf_paged.Engine`.

HTTP handlers never call the engine. They :meth:`~EngineLoop.submit` a :class:`~hf_paged.server._sampling.Job` and
:meth:`~EngineLoop.cancel` it through a thread-safe command queue, and receive its events (:data:`Event`) on their own
``asyncio.Queue`` (posted with ``loop.call_soon_threadsafe``): that the request was accepted, its new tokens, each
choice's end, or a ``ServerError`` to answer with (nothing was queued, the server is stopping, or the request was
given up). The thread drains the commands between steps, steps while anything is live and sleeps on the command
queue when idle. Tokenizing, the chat template and the length and cost checks run before, on a tokenizer thread of
their own (:mod:`~hf_paged.server._prompts`), and a ``json_schema`` is compiled before that on a grammar thread (the
engine's copies of it then cost microseconds), so neither a long prompt nor a large schema holds up the steps of the
requests already running.

A streamed request whose client does not read (its handler's queue holds more than
:data:`STREAM_BACKLOG_PER_CHOICE` events per choice) is aborted, so that it stops generating and holds no memory.

Nothing one request carries can stop the thread: a request whose admission or step fails is answered with an error
and the thread goes on. Should the thread itself ever die (a bug), every waiting client is answered at once,
``/health`` says why, and ``on_death`` is called (``hf-paged serve`` then exits non-zero, for a supervisor to
restart it) instead of leaving requests hanging.

Tokens are matched to requests by the ids the engine reports, never by the step that scheduled them: under
asynchronous scheduling a step hands back the tokens of the step before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hf_paged.engine import Engine
from hf_paged.engine._request_output import RequestOutput, TokenDelta
from hf_paged.engine._validation import CHILD_MARK
from hf_paged.server._errors import ServerError, bad_request
from hf_paged.server._metrics import ServerMetrics
from hf_paged.server._prompts import Prepared, PromptBuilder
from hf_paged.server._sampling import Job

logger = logging.getLogger("hf_paged")
STREAM_BACKLOG_PER_CHOICE = 64  # events a stream's client may leave unread, per choice, before it is given up
GRAMMAR_THREADS = 2


@dataclass(frozen=True)
class Accepted:
    """The request is queued in the engine."""


@dataclass(frozen=True)
class Delta:
    """New tokens of choice ``index`` (streamed requests only; its :class:`Finished` says how it ended).
    ``token_texts`` (the text of each id the tokens and their alternatives name) is set when the request asked for
    logprobs."""

    index: int
    tokens: TokenDelta
    token_texts: dict[int, str] | None = None


@dataclass(frozen=True)
class Finished:
    """Choice ``index`` is done; ``output.finish_reason`` may be ``"error"`` (``output.error`` says why).
    ``token_texts`` (each id of the new tokens, of the prompt's with ``echo``, and of their alternatives, decoded
    alone) is set when the request asked for logprobs."""

    index: int
    output: RequestOutput
    token_texts: dict[int, str] | None = None


Event = Accepted | ServerError | Delta | Finished


@dataclass(eq=False)
class Submission:
    """A job as the engine thread keeps it while it is live (compared and hashed by identity)."""

    id: str
    job: Job
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    prepared: Prepared | None = None
    request_ids: list[str] = field(default_factory=list)
    remaining: int = 0
    abandoned: bool = False

    def post(self, event: Event) -> None:
        if self.abandoned:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is gone
            self.abandoned = True


class EngineLoop:
    """Runs ``engine`` on a daemon thread; at most ``capacity`` sequences (copies of ``n`` count one each) are live
    at once, more are refused with 429 by :meth:`submit`; ``prompts`` makes each job's prompts token ids.
    ``on_death`` (any thread may call it) is told if the thread ever dies. ``metrics`` holds what ``GET /metrics``
    reports; ``thread`` is the engine's thread (started by the app's lifespan)."""

    def __init__(self, engine: Engine, capacity: int, prompts: PromptBuilder, on_death: Callable[[str], None] | None):
        self.engine, self.metrics, self.capacity, self.prompts = engine, ServerMetrics(engine.stats), capacity, prompts
        self.on_death = on_death
        self.death: str | None = None  # why the thread died, once it has
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock, self._reserved, self._stopping = threading.Lock(), 0, False  # (the lock guards the other two)
        self._ids = itertools.count()
        self._live: dict[str, Submission] = {}  # by engine request id (one per prompt)
        self._token_texts: dict[int, str] = {}  # each token id decoded alone (the engine thread's cache)
        self.thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="hf-paged-tokenizer")
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="hf-paged-grammar")

    # ----- the HTTP side (any thread) --------------------------------------------------------------------------
    async def submit(self, job: Job) -> Submission:
        """Reserve room for ``job`` (429 when the server is full, 503 when it stops), compile its schema on a grammar
        thread, tokenize and check its prompts on the tokenizer thread (400s), and queue it; its events go to the
        submission's ``events``, which the caller reads."""
        seqs = len(job.prompts) * job.n
        with self._lock:
            if self.death is not None:
                raise ServerError(503, f"the engine loop is not running: {self.death}", code="engine_dead")
            if self._stopping:
                raise ServerError(503, "the server is shutting down; retry on another instance", code="shutting_down")
            if self._reserved + seqs > self.capacity:
                self.metrics.rejected("queue_full")
                raise ServerError(429, f"the server is full ({self._reserved} sequences running or queued, at most "
                                       f"{self.capacity}: --max-num-seqs + --max-queued-requests); retry later",
                                  code="queue_full")
            self._reserved += seqs
        loop = asyncio.get_running_loop()
        sub = Submission(f"{next(self._ids)}", job, asyncio.Queue(), loop, time.perf_counter())
        try:
            if "json_schema" in job.settings:
                await loop.run_in_executor(self._grammar_pool, self._compile, job.settings["json_schema"])
            sub.prepared = await loop.run_in_executor(self._tokenizer_pool, self.prompts.prepare, job)
        except BaseException as exc:  # a 400, an unexpected error, or the handler cancelled
            self._release(sub)
            if isinstance(exc, ServerError) and exc.status == 400:
                self.metrics.rejected("invalid")
            raise
        self._commands.put(("submit", sub))
        if self.death is not None:  # (the thread died meanwhile: nothing would answer)
            raise ServerError(503, f"the engine loop is not running: {self.death}", code="engine_dead")
        return sub

    def cancel(self, sub: Submission) -> None:
        """The client is gone: abort ``sub``'s requests (their blocks are freed by the next step)."""
        self._commands.put(("cancel", sub))

    def begin_stop(self) -> None:
        """Refuse new jobs and abort what is live, each answered 503 (returns at once)."""
        with self._lock:
            self._stopping = True
        self._commands.put(("stop", None))

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is live, let the engine hand it back, and end the threads."""
        self.begin_stop()
        self.thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def _release(self, sub: Submission) -> None:
        with self._lock:
            self._reserved -= len(sub.job.prompts) * sub.job.n

    def _compile(self, schema: str) -> None:
        """(A grammar thread.) Compile ``schema`` into the engine's cache, which the engine thread then copies."""
        try:
            self.engine.structured.compiled(schema)
        except ValueError as exc:
            raise bad_request(str(exc), "response_format", "invalid_json_schema") from None

    # ----- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        """The thread's loop: take the handlers' commands (waiting for one when idle) and step while anything is
        live, until stopped and drained; anything that escapes it is the thread's death."""
        stopping = False
        try:
            while (busy := self.engine.has_unfinished()) or not stopping:
                for kind, sub in self._take_commands(block=not busy):
                    if kind == "stop":
                        stopping = True
                        self._abort_live(ServerError(503, "the server is shutting down; the request was aborted",
                                                     code="shutting_down"))
                    else:
                        self._command(kind, sub, stopping)
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:
            logger.exception("hf_paged: the engine loop died; the server cannot serve any more")
            self._die(f"{type(exc).__name__}: {exc}")

    def _command(self, kind: str, sub: Submission, stopping: bool) -> None:
        """One handler's command; whatever it raises ends that request only."""
        try:
            if kind == "cancel":
                self._give_up(sub)
            elif stopping:
                self._fail(sub, ServerError(503, "the server is shutting down", code="shutting_down"))
            else:
                self._admit(sub)
        except Exception as exc:
            logger.exception("hf_paged: serving one request failed; the others go on")
            self._fail(sub, ServerError(500, f"unexpected {type(exc).__name__}: {exc}", code="internal_error"))

    def _die(self, reason: str) -> None:
        self.death = reason  # (submit refuses new jobs from now on)
        error = ServerError(500, f"the engine loop died: {reason}", code="engine_dead")
        queued = [sub for kind, sub in self._take_commands(block=False) if kind == "submit"]
        for sub in [*dict.fromkeys(self._live.values()), *queued]:
            sub.post(error)
        if self.on_death is not None:
            self.on_death(reason)

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while not self._commands.empty():  # (this thread alone takes commands: what is there stays there)
            commands.append(self._commands.get_nowait())
        return commands

    def _admit(self, sub: Submission) -> None:
        prepared = sub.prepared
        sub.request_ids = [f"{sub.id}-{p}" for p in range(len(prepared.prompts))]
        try:
            self.engine.add_requests(prepared.prompts, prepared.configs, sub.request_ids)
        except ValueError as exc:  # (all are checked before any is queued: nothing was)
            self._fail(sub, bad_request(str(exc)))
            return
        self._live.update(dict.fromkeys(sub.request_ids, sub))
        sub.remaining = len(prepared.prompts) * sub.job.n
        sub.post(Accepted())

    def _fail(self, sub: Submission, error: ServerError) -> None:
        """End ``sub``'s requests (those queued already), and answer it with ``error``."""
        self._end(sub)
        self.metrics.rejected("invalid" if error.status == 400 else str(error.status))
        sub.post(error)

    def _abort_live(self, error: ServerError) -> None:
        for sub in dict.fromkeys(self._live.values()):
            self._give_up(sub, error)

    def _give_up(self, sub: Submission, error: ServerError | None = None) -> None:
        """Answer ``sub`` with ``error`` (None: its client is gone) and abort its requests: their abort outputs come
        from the next step and release its capacity then."""
        if error is not None:
            sub.post(error)
        sub.abandoned = True
        for rid in sub.request_ids:
            self.engine.abort(rid)

    def _step(self) -> None:
        try:
            outputs, deltas = self.engine.step_with_deltas()
        except Exception as exc:  # the engine commits a step whole; a step that raises fails what is live
            logger.exception("hf_paged: an engine step failed; failing the live requests")
            self._abort_live(ServerError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error"))
            return
        now = time.perf_counter()
        for delta in deltas:
            self._take_delta(delta, now)
        for out in outputs:
            self._take_output(out)

    def _choice(self, request_id: str) -> tuple[Submission | None, int]:
        rid, _, copy = request_id.partition(CHILD_MARK)
        if (sub := self._live.get(rid)) is None:
            return None, 0
        prompt = int(rid.rsplit("-", 1)[1])
        return sub, prompt * sub.job.n + (int(copy) + 1 if copy else 0)

    def _take_delta(self, delta: TokenDelta, now: float) -> None:
        sub, index = self._choice(delta.request_id)
        if sub is None or (not delta.token_ids and not delta.finished):
            return
        if delta.token_ids:
            self.metrics.generated(delta.request_id, len(delta.token_ids), sub.arrival, now)
        if sub.job.stream and not sub.abandoned:
            if (unread := sub.events.qsize()) > STREAM_BACKLOG_PER_CHOICE * len(sub.job.prompts) * sub.job.n:
                self._give_up(sub, ServerError(408, f"the client left {unread} chunks of its stream unread; the "
                                                    "request was aborted", code="stream_not_read"))
            else:
                texts = self._texts(delta.token_ids, delta.top_logprobs) if sub.job.logprobs else None
                sub.post(Delta(index, delta, texts))

    def _take_output(self, out: RequestOutput) -> None:
        sub, index = self._choice(out.request_id)
        self.metrics.finished(out.request_id, out.finish_reason if sub is not None else None)
        if sub is None:
            return
        if not sub.abandoned:
            ids = [*out.prompt_token_ids, *out.token_ids] if sub.job.echo else out.token_ids
            texts = self._texts(ids, out.top_logprobs, out.prompt_top_logprobs) if sub.job.logprobs else None
            sub.post(Finished(index, out, texts))
        sub.remaining -= 1
        if sub.remaining <= 0 or out.finish_reason in ("error", "abort"):
            # an error or abort ends the whole job: the handler answers at once, and copies of n that were never
            # forked would never report
            self._end(sub)

    def _texts(self, ids: list[int], *alternatives) -> dict[int, str]:
        """Each id of ``ids`` and of the ``(id, logprob)`` lists in ``alternatives``, decoded alone."""
        wanted = set(ids)
        for rows in alternatives:  # (a token's alternatives, or None where none were asked)
            for row in rows or ():
                wanted.update(t for t, _ in row or ())
        cache, tokenizer = self._token_texts, self.engine.tokenizer
        for t in wanted - cache.keys():
            cache[t] = tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"
        return {t: cache[t] for t in wanted}

    def _end(self, sub: Submission) -> None:
        """Abort ``sub``'s requests still in the engine, forget them and release the room ``sub`` reserved."""
        for rid in sub.request_ids:
            self.engine.abort(rid)
            self._live.pop(rid, None)
        sub.request_ids = []
        self._release(sub)
