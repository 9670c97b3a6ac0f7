"""``EngineLoop``: the one thread that owns the :class:`~hf_paged.Engine`.

HTTP handlers never call the engine. They :meth:`~EngineLoop.submit` a :class:`~hf_paged.server._sampling.Job` and
:meth:`~EngineLoop.cancel` it through a thread-safe command queue, and receive :mod:`~hf_paged.server._events` on
their own ``asyncio.Queue`` (posted with ``loop.call_soon_threadsafe``). The thread drains the commands between
steps, steps while anything is live and sleeps on the command queue when idle. Tokenizing, the chat template and
the length checks run on this thread too, so the tokenizer is only ever used by one thread.

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
from dataclasses import dataclass, field

from hf_paged.engine import Engine
from hf_paged.engine._request_output import RequestOutput, TokenDelta
from hf_paged.engine._validation import CHILD_MARK
from hf_paged.server._errors import ServerError, bad_request
from hf_paged.server._events import Accepted, Delta, Event, Finished, Rejected
from hf_paged.server._metrics import ServerMetrics
from hf_paged.server._prompts import PromptBuilder
from hf_paged.server._sampling import Job

logger = logging.getLogger("hf_paged")
STATS_EVERY_S = 0.05  # how often a busy loop refreshes the stats that /metrics reads


@dataclass
class Submission:
    """A job as the engine thread keeps it while it is live."""

    id: str
    job: Job
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
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


@dataclass
class _Timing:
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0


class EngineLoop:
    """Runs ``engine`` on a daemon thread; at most ``capacity`` sequences (copies of ``n`` count one each) are live
    at once, more are refused with 429 by :meth:`submit`."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, capacity: int, chat_template: str | None = None):
        self.engine, self.metrics, self.capacity = engine, metrics, capacity
        self.prompts = PromptBuilder(engine, chat_template)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._reserved = 0
        self._stopping = False
        self._ids = itertools.count()
        self._live: dict[str, Submission] = {}  # by engine request id (one per prompt)
        self._timings: dict[str, _Timing] = {}
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self.stats: dict = engine.stats()

    # ----- the HTTP side (any thread) --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, events: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> Submission:
        """Queue ``job``; its events go to ``events``. Raises 429 when the server is full, 503 when stopping."""
        seqs = len(job.prompts) * job.n
        with self._lock:
            if self._stopping:
                raise ServerError(503, "the server is shutting down; retry on another instance", code="shutting_down")
            if self._reserved + seqs > self.capacity:
                self.metrics.rejected("queue_full")
                raise ServerError(429, f"the server is full ({self._reserved} sequences running or queued, at most "
                                       f"{self.capacity}: --max-num-seqs + --max-queued-requests); retry later",
                                  code="queue_full")
            self._reserved += seqs
            sub = Submission(f"{next(self._ids)}", job, events, loop, time.perf_counter())
        self._commands.put(("submit", sub))
        return sub

    def cancel(self, sub: Submission) -> None:
        """The client is gone: abort ``sub``'s requests (their blocks are freed by the next step)."""
        self._commands.put(("cancel", sub))

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is live, let the engine hand it back, and end the thread."""
        with self._lock:
            self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ----- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        stopping, last_stats = False, 0.0
        while True:
            busy = self.engine.has_unfinished()
            if not busy and stopping:
                break
            for kind, sub in self._take_commands(block=not busy):
                if kind == "submit":
                    self._admit(sub) if not stopping else self._reject(sub, ServerError(503, "shutting down"))
                elif kind == "cancel":
                    sub.abandoned = True
                    self._abort(sub)
                else:
                    stopping = True
                    for s in self._live_submissions():
                        s.post(Rejected(ServerError(503, "the server is shutting down; the request was aborted",
                                                    code="shutting_down")))
                        s.abandoned = True
                        self._abort(s)
            if self.engine.has_unfinished():
                self._step()
            now = time.perf_counter()
            if now - last_stats > STATS_EVERY_S or not self.engine.has_unfinished():
                self.stats, last_stats = self.engine.stats(), now
                self.metrics.engine_stats(self.stats)

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _admit(self, sub: Submission) -> None:
        job = sub.job
        try:
            prompts = [self.prompts.token_ids(p, job.chat) for p in job.prompts]
            configs = [job.generation_config(self.prompts.max_new_tokens(len(ids), job.max_tokens, job.chat))
                       for ids in prompts]
            for p, (ids, config) in enumerate(zip(prompts, configs)):
                rid = f"{sub.id}-{p}"
                self.engine.add_request(ids, config, request_id=rid)
                sub.request_ids.append(rid)
                self._live[rid] = sub
        except (ServerError, ValueError) as exc:
            self._abort(sub)  # the prompts queued already; their abort outputs find no job and are dropped
            self._forget(sub)
            self._reject(sub, exc if isinstance(exc, ServerError) else bad_request(str(exc)))
            return
        sub.remaining = len(prompts) * job.n
        sub.post(Accepted([len(ids) for ids in prompts]))

    def _reject(self, sub: Submission, error: ServerError) -> None:
        self.metrics.rejected("invalid" if error.status == 400 else str(error.status))
        sub.post(Rejected(error))

    def _abort(self, sub: Submission) -> None:
        for rid in sub.request_ids:
            self.engine.abort(rid)

    def _step(self) -> None:
        try:
            outputs, deltas = self.engine.step_with_deltas()
        except Exception as exc:  # the engine commits a step whole; a step that raises fails what is live
            logger.exception("hf_paged: an engine step failed; failing the live requests")
            self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        for delta in deltas:
            self._take_delta(delta, now)
        for out in outputs:
            self._take_output(out, now)

    def _choice(self, request_id: str) -> tuple[Submission | None, int]:
        rid, _, copy = request_id.partition(CHILD_MARK)
        sub = self._live.get(rid)
        if sub is None:
            return None, 0
        prompt = int(rid.rsplit("-", 1)[1])
        return sub, prompt * sub.job.n + (int(copy) + 1 if copy else 0)

    def _take_delta(self, delta: TokenDelta, now: float) -> None:
        sub, index = self._choice(delta.request_id)
        if sub is None or (not delta.token_ids and not delta.finished):
            return
        if delta.token_ids:
            timing = self._timings.setdefault(delta.request_id, _Timing())
            if timing.tokens == 0:
                timing.first = now
                self.metrics.first_token(now - sub.arrival)
            timing.last, timing.tokens = now, timing.tokens + len(delta.token_ids)
            self.metrics.generated(len(delta.token_ids), now)
        if sub.job.stream:
            sub.post(Delta(index, list(delta.token_ids), delta.text or "", delta.finish_reason))

    def _take_output(self, out: RequestOutput, now: float) -> None:
        sub, index = self._choice(out.request_id)
        timing = self._timings.pop(out.request_id, None)
        if sub is None:
            return
        if timing is not None and timing.tokens > 1:
            self.metrics.per_output_token((timing.last - timing.first) / (timing.tokens - 1))
        self.metrics.finished(out.finish_reason)
        if not sub.abandoned:
            texts = [self.engine.tokenizer.decode([t]) for t in out.token_ids] if sub.job.logprobs else None
            sub.post(Finished(index, out, texts))
        sub.remaining -= 1
        if sub.remaining <= 0 or out.finish_reason in ("error", "abort"):
            # an error or abort ends the whole job: the handler answers at once, and copies of n that were never
            # forked would never report
            self._abort(sub)
            self._forget(sub)

    def _forget(self, sub: Submission) -> None:
        for rid in sub.request_ids:
            self._live.pop(rid, None)
        with self._lock:
            self._reserved -= len(sub.job.prompts) * sub.job.n

    def _fail_all(self, reason: str) -> None:
        for sub in self._live_submissions():
            sub.post(Rejected(ServerError(500, reason, code="engine_error")))
            sub.abandoned = True
            self._abort(sub)  # their abort outputs come from the next step and release their capacity then

    def _live_submissions(self) -> list[Submission]:
        return list({id(s): s for s in self._live.values()}.values())
