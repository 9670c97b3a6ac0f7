"""``ServerMetrics``: what ``GET /metrics`` reports, in Prometheus' text exposition format (written here, no
client library needed).

The engine thread records tokens, latencies and finished requests; a worker thread of the HTTP side renders them
with the engine's ``stats()`` of that moment (which takes the engine's lock). One lock guards both sides.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable

PREFIX = "hf_paged"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0
#: The gauges and counters of one value: (kind, name, help, the key of the value in the engine's ``stats()`` or
#: ``tokens_per_second``, the server's own).
METRICS = (
    ("gauge", "requests_running", "sequences running in the engine", "running"),
    ("gauge", "requests_waiting", "sequences queued in the engine", "waiting"),
    ("gauge", "kv_blocks_used", "KV blocks held by sequences", "used_blocks"),
    ("gauge", "kv_blocks_total", "KV blocks in the pool", "num_blocks"),
    ("gauge", "kv_blocks_cached", "free KV blocks still findable by the prefix cache", "cached_blocks"),
    ("counter", "prompt_tokens", "prompt tokens queued", "prompt_tokens"),
    ("counter", "generation_tokens", "tokens generated", "generated_tokens"),
    ("gauge", "generation_tokens_per_second", f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
     "tokens_per_second"),
    ("counter", "preemptions", "sequences preempted (recomputed later) for want of KV blocks", "preemptions"),
    ("counter", "prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", "prefix_cache_hit_tokens"),
    ("counter", "engine_steps", "engine steps run", "steps"),
)


class Histogram:
    """Cumulative buckets, their sum and count, as Prometheus keeps them."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        self.counts = [count + (value <= bound) for count, bound in zip(self.counts, self.bounds)]
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip((*self.bounds, "+Inf"), (*self.counts, self.count))]
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class ServerMetrics:
    """The server's own counts and histograms; ``stats`` is the engine's ``stats`` method."""

    def __init__(self, stats: Callable[[], dict]):
        self._lock, self._stats = threading.Lock(), stats
        self._ttft, self._tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)
        self._finished, self._rejected = Counter(), Counter()  # by finish reason; by why
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last RATE_WINDOW_S seconds
        self._timings: dict[str, tuple[float, float, int]] = {}  # (first, last token's time, tokens) by request id

    # ----- recording (the engine thread; rejected() also the HTTP side) ---------------------------------------
    def generated(self, request_id: str, tokens: int, arrival: float, now: float) -> None:
        """``tokens`` new tokens of ``request_id`` (of a request that arrived at ``arrival``) came at ``now``."""
        with self._lock:
            first, _, count = self._timings.get(request_id, (now, now, 0))
            if count == 0:
                self._ttft.observe(now - arrival)
            self._timings[request_id] = (first, now, count + tokens)
            self._recent.append((now, tokens))

    def finished(self, request_id: str, reason: str | None) -> None:
        """``request_id`` is done; counted under ``reason`` (None: a request no client waits for, not counted)."""
        with self._lock:
            first, last, count = self._timings.pop(request_id, (0.0, 0.0, 0))
            if count > 1:
                self._tpot.observe((last - first) / (count - 1))
            if reason is not None:
                self._finished[reason] += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    # ----- rendering -------------------------------------------------------------------------------------------
    def render(self) -> str:
        stats = self._stats()  # (before our lock: the engine's may wait for a step)
        with self._lock:
            now = time.perf_counter()
            while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
                self._recent.popleft()
            values = {**stats, "tokens_per_second": sum(n for _, n in self._recent) / RATE_WINDOW_S}
            out: list[str] = []
            for kind, name, help_, key in METRICS:
                full = f"{PREFIX}_{name}_total" if kind == "counter" else f"{PREFIX}_{name}"
                out += [*_header(name, help_, kind), f"{full} {values.get(key, 0)}"]
            for name, help_, label, counts in (
                    ("request_success", "sequences finished, by finish_reason", "finish_reason", self._finished),
                    ("requests_rejected", "requests refused before they were queued, by reason", "reason",
                     self._rejected)):
                out += _header(name, help_, "counter")
                out += [f'{PREFIX}_{name}_total{{{label}="{key}"}} {n}' for key, n in sorted(counts.items())]
            for name, help_, hist in (("time_to_first_token_seconds", "arrival to first token", self._ttft),
                                      ("time_per_output_token_seconds", "mean time between a sequence's tokens",
                                       self._tpot)):
                out += _header(name, help_, "histogram") + hist.lines(f"{PREFIX}_{name}")
            return "\n".join(out) + "\n"


def _header(name: str, help_: str, kind: str) -> list[str]:
    return [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}"]
