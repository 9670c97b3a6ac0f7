"""``EngineStats``: counters the engine keeps and the ``stats()`` dict it reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields


@dataclass
class EngineStats:
    """Token and step counters plus host time per step phase (schedule, plan, forward, sample, update)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_used_blocks: int = 0
    kv_resets: int = 0  # times the KV was forgotten: the weights changed, or reset_prefix_cache()
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def clock(self) -> Callable[[str], None]:
        """A stopwatch: each call adds the time since the previous one to the named phase."""
        last = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal last
            now = time.perf_counter()
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + now - last
            last = now

        return lap

    def note_step(self, used_blocks: int) -> None:
        self.steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, used_blocks)

    def counts(self) -> dict:
        """The counters' ``stats()`` keys."""
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "phase_seconds"}
        return {**counts, "ms_per_step": {k: 1e3 * v / max(self.steps, 1) for k, v in self.phase_seconds.items()}}
