"""``EngineStats``: counters the engine keeps and the ``stats()`` dict it reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    scheduled_tokens: int = 0
    steps: int = 0
    peak_used_blocks: int = 0

    def note_step(self, engine) -> None:
        self.steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, engine.cache.pool.allocator.num_used)

    def snapshot(self, engine) -> dict:
        alloc = engine.cache.pool.allocator
        served = dict(engine.cache.dispatcher.served)
        return {
            "num_blocks": alloc.num_blocks,
            "block_size": engine.cache.block_size,
            "free_blocks": alloc.num_free,  # blocks kept only by the prefix cache count as free
            "used_blocks": alloc.num_used,
            "peak_used_blocks": self.peak_used_blocks,
            "cached_blocks": engine.block_manager.num_cached_blocks,
            "preemptions": engine.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": engine.block_manager.prefix_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "prefill_backend": served.get("prefill") or served.get("extend"),
            "decode_backend": served.get("decode"),
            "backends": served,
        }
