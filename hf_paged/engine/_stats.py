"""``EngineStats``: counters the engine keeps and the ``stats()`` dict it reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


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

    def note_step(self, engine) -> None:
        self.steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, engine.pool.allocator.num_used)

    def snapshot(self, engine) -> dict:
        alloc = engine.pool.allocator
        served = dict(engine.dispatcher.served)
        return {
            "num_blocks": alloc.num_blocks,
            "block_size": engine.pool.block_size,
            "free_blocks": alloc.num_free,  # blocks kept only by the prefix cache count as free
            "used_blocks": alloc.num_used,
            "peak_used_blocks": self.peak_used_blocks,
            "cached_blocks": engine.block_manager.num_cached_blocks,
            "preemptions": engine.scheduler.num_preemptions,
            "kv_resets": self.kv_resets,
            "prefix_cache_hit_tokens": engine.block_manager.prefix_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "prefill_backend": served.get("prefill") or served.get("extend"),
            "decode_backend": served.get("decode"),
            "backends": served,
            "kv_cache_dtype": str(engine.pool.dtype).removeprefix("torch."),
            "ms_per_step": {k: 1e3 * v / max(self.steps, 1) for k, v in self.phase_seconds.items()},
            "cuda_graphs": engine.graphs.stats() if engine.graphs is not None else None,
            "compiled_layers": engine.compiled is not None and engine.compiled.enabled,
            "skinny_linear": engine.skinny_linear,
            "max_batch_tokens": engine.config.max_batch_tokens,
            "max_num_seqs": engine.config.max_num_seqs,
            "cuda_graph_capture": engine.config.cuda_graph_capture if engine.graphs is not None else None,
            "sizing": dict(engine.sizing),  # the automatic settings, each with why it was picked (given: absent)
        }
