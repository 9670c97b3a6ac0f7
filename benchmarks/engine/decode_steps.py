"""Driving an ``hf_paged.Engine`` into steady decode through its public API, and reading its phase timers.

Shared by ``benchmarks/engine/overhead.py`` and the decode profile of ``benchmarks/e2e/throughput.py``.
"""

from __future__ import annotations

import hf_paged


def step_until_decoding(engine: hf_paged.Engine, max_steps: int = 100_000) -> int:
    """Step until no prompt is left to prefill: nothing waits and every running request sampled a token in the
    last step (a request still prefilling samples nothing). Returns the number of steps taken."""
    before = engine.stats()["generated_tokens"]
    for n in range(1, max_steps + 1):
        engine.step()
        stats = engine.stats()
        if not stats["waiting"] and stats["running"] and stats["generated_tokens"] - before == stats["running"]:
            return n
        before = stats["generated_tokens"]
    raise RuntimeError(f"the engine still prefills after {max_steps} steps; is the workload larger than the cache?")


def phase_ms_between(before: dict, after: dict) -> dict[str, float]:
    """Mean host milliseconds per step of each phase over the steps between two ``engine.stats()`` snapshots."""
    steps = after["steps"] - before["steps"]
    total = lambda stats, phase: stats["ms_per_step"].get(phase, 0.0) * stats["steps"]
    return {phase: (total(after, phase) - total(before, phase)) / max(steps, 1) for phase in after["ms_per_step"]}
