"""Engine with an fp8 KV cache (kv_cache_dtype="fp8"): a workload runs to the end on the torch backend."""

from __future__ import annotations

import hf_paged
from engine_helpers import greedy_config, models, random_prompts


def test_engine_with_fp8_kv_runs_a_workload_to_the_end_without_leaking_blocks():
    prompts = random_prompts(6, 3, 20, seed=3)
    results = {}
    for kv in (None, "fp8"):
        engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=48, block_size=4, max_batch_tokens=32,
                                 kv_cache_dtype=kv)
        results[kv] = [o.token_ids for o in engine.generate(prompts, greedy_config(8))]
        stats = engine.stats()
        assert stats["free_blocks"] == stats["num_blocks"] and not engine.has_unfinished()
        assert all(len(t) == 8 for t in results[kv])
    assert engine.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    assert engine.stats()["backends"]["decode"] == "torch"
    agree = sum(a == b for x, y in zip(results[None], results["fp8"]) for a, b in zip(x, y)) / 48
    print(f"\nengine fp8 vs float32 KV: greedy token agreement {agree:.3f}")
    assert agree >= 0.5  # random tiny model, flat logits: a near-tie may flip and the run diverge after it


def test_generate_batch_reads_kv_cache_dtype_from_the_continuous_batching_config():
    from types import SimpleNamespace

    from hf_paged.engine._generate_batch import _KEPT

    paged = models("llama_gqa")[1]
    config = SimpleNamespace(num_blocks=48, block_size=4, max_batch_tokens=32, kv_cache_dtype="fp8")
    out = hf_paged.generate_batch(paged, random_prompts(3, 3, 12, seed=4), greedy_config(4),
                                  continuous_batching_config=config, persistent_manager=True)
    engine = paged.__dict__.pop(_KEPT)[1]
    assert engine.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    assert all(len(o.generated_tokens) == 4 for o in out.values())
