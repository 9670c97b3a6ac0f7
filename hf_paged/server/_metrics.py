"""``ServerMetrics``: what ``GET /metrics`` reports, in Prometheus' text exposition format (written here, no
client library needed).

The engine thread records tokens, latencies and finished requests and publishes the engine's ``stats()``; the
HTTP thread renders. One lock guards both sides.
"""

from __future__ import annotations

import threading
import time
from collections import deque

PREFIX = "hf_paged"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0


class Histogram:
    """Cumulative buckets, their sum and count, as Prometheus keeps them."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.bounds, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class ServerMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._ttft, self._tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)
        self._finished: dict[str, int] = {}
        self._rejected: dict[str, int] = {}
        self._generated = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last RATE_WINDOW_S seconds
        self._engine: dict = {}

    # ----- recording (the engine thread; rejected() also the HTTP thread) -------------------------------------
    def first_token(self, seconds: float) -> None:
        with self._lock:
            self._ttft.observe(seconds)

    def per_output_token(self, seconds: float) -> None:
        with self._lock:
            self._tpot.observe(seconds)

    def generated(self, tokens: int, now: float) -> None:
        with self._lock:
            self._generated += tokens
            self._recent.append((now, tokens))

    def finished(self, reason: str) -> None:
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def engine_stats(self, stats: dict) -> None:
        with self._lock:
            self._engine = stats

    # ----- rendering -------------------------------------------------------------------------------------------
    def render(self) -> str:
        with self._lock:
            now = time.perf_counter()
            while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
                self._recent.popleft()
            rate = sum(n for _, n in self._recent) / RATE_WINDOW_S
            e = self._engine
            out: list[str] = []
            gauge = _family(out, "gauge")
            counter = _family(out, "counter")
            gauge("requests_running", "sequences running in the engine", e.get("running", 0))
            gauge("requests_waiting", "sequences queued in the engine", e.get("waiting", 0))
            gauge("kv_blocks_used", "KV blocks held by sequences", e.get("used_blocks", 0))
            gauge("kv_blocks_total", "KV blocks in the pool", e.get("num_blocks", 0))
            gauge("kv_blocks_cached", "free KV blocks still findable by the prefix cache", e.get("cached_blocks", 0))
            counter("prompt_tokens", "prompt tokens queued", e.get("prompt_tokens", 0))
            counter("generation_tokens", "tokens generated", self._generated)
            gauge("generation_tokens_per_second", f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
                  rate)
            counter("preemptions", "sequences preempted (recomputed later) for want of KV blocks",
                    e.get("preemptions", 0))
            counter("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                    e.get("prefix_cache_hit_tokens", 0))
            counter("engine_steps", "engine steps run", e.get("steps", 0))
            _labelled(out, "request_success", "sequences finished, by finish_reason", "finish_reason",
                      self._finished)
            _labelled(out, "requests_rejected", "requests refused before they were queued, by reason", "reason",
                      self._rejected)
            for name, help_, hist in (("time_to_first_token_seconds", "arrival to first token", self._ttft),
                                      ("time_per_output_token_seconds", "mean time between a sequence's tokens",
                                       self._tpot)):
                out += [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} histogram"]
                out += hist.lines(f"{PREFIX}_{name}")
            return "\n".join(out) + "\n"


def _family(out: list[str], kind: str):
    def add(name: str, help_: str, value: float) -> None:
        full = f"{PREFIX}_{name}_total" if kind == "counter" else f"{PREFIX}_{name}"
        out.extend([f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}", f"{full} {value}"])

    return add


def _labelled(out: list[str], name: str, help_: str, label: str, counts: dict[str, int]) -> None:
    out.extend([f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} counter"])
    out.extend(f'{PREFIX}_{name}_total{{{label}="{key}"}} {n}' for key, n in sorted(counts.items()))
