"""``EngineConfig``: one validated record of the engine's settings, shared by ``Engine`` (keywords or ``config=``),
``generate_batch`` and the CLI's defaults."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import replace

import pytest
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from hf_paged import EngineConfig

ARCH = "llama_gqa"


@pytest.mark.parametrize("bad", [
    dict(num_blocks=None, block_size=0), dict(max_num_seqs=True), dict(num_blocks=0), dict(num_blocks=-1),
    dict(block_size=16.0), dict(max_batch_tokens=0), dict(memory_budget=0), dict(memory_budget=1.5),
    dict(memory_budget=float("nan")), dict(enable_prefix_caching="yes"), dict(async_scheduling=1),
    dict(backend="no-such-backend"), dict(backend=[1]), dict(cuda_graphs=[0]), dict(cuda_graphs="yes"),
    dict(cuda_graph_capture="lazy"), dict(cuda_graph_capture=""), dict(max_batch_tokens=-1), dict(max_num_seqs=0.5),
    dict(num_blocks=10**11), dict(num_blocks=2**27, block_size=16), dict(max_batch_tokens=2**31),
    dict(max_num_seqs=2**31),
], ids=str)
def test_bad_settings_raise_one_line_from_the_config_and_the_engine(bad):
    with pytest.raises(ValueError) as err:
        EngineConfig(**bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError):
        hf_paged.Engine(models(ARCH)[1], **bad)


def test_a_pool_larger_than_the_memory_it_would_take_is_refused_before_anything_is_allocated():
    """Within the int32 slot ids but beyond the machine: the engine says so at once (it filled memory for minutes)."""
    from hf_paged.cache._kv_pool import total_memory_bytes

    model = models(ARCH)[1]
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    blocks = total_memory_bytes(model.device) // per_block + 1
    with pytest.raises(ValueError, match="GiB of KV cache") as err:
        hf_paged.Engine(model, num_blocks=int(blocks))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="GiB of KV cache"):
        hf_paged.PagedAttentionCache(model.config, num_blocks=int(blocks), dtype=model.dtype)


def test_engine_signature_shows_the_config_defaults():
    params = inspect.signature(hf_paged.Engine).parameters
    defaults = EngineConfig()
    for name in EngineConfig.field_names():
        assert params[name].default == getattr(defaults, name), name


def test_config_and_keywords_build_the_same_engine_and_cannot_be_mixed():
    model = models(ARCH)[1]
    prompts = random_prompts(3, 4, 12, seed=1)
    cfg = EngineConfig(num_blocks=40, block_size=4, max_batch_tokens=16, max_num_seqs=2, backend="torch")
    by_config = hf_paged.Engine(model, config=cfg)
    by_keywords = hf_paged.Engine(model, num_blocks=40, block_size=4, max_batch_tokens=16, max_num_seqs=2,
                                  backend=["torch"])
    # the engine's config is the given one with the automatic setting it picked (the graphs' capture)
    assert by_config.config == by_keywords.config == replace(cfg, cuda_graph_capture="first_use")
    assert cfg.backend == ("torch",) and set(by_config.stats()["sizing"]) == {"cuda_graph_capture"}
    refs = hf_greedy(ARCH, prompts, 5)
    assert [o.token_ids for o in by_config.generate(prompts, greedy_config(5))] == refs
    assert by_config.stats()["num_blocks"] == 40 and by_config.scheduler.max_num_seqs == 2
    with pytest.raises(ValueError, match="not both"):
        hf_paged.Engine(model, block_size=8, config=cfg)
    with pytest.raises(ValueError, match="EngineConfig"):
        hf_paged.Engine(model, config={"block_size": 4})
    with pytest.raises(ValueError, match="GenerationConfig"):
        hf_paged.Engine(model, generation_config={"max_new_tokens": 4})


def test_generate_batch_takes_an_engine_config_and_checks_transformers_settings():
    model = models(ARCH)[1]
    prompts = random_prompts(2, 4, 9, seed=2)
    refs = hf_greedy(ARCH, prompts, 4)
    out = hf_paged.generate_batch(model, prompts, greedy_config(4), EngineConfig(num_blocks=None, block_size=4))
    assert [out[f"req_{i}"].generated_tokens for i in range(2)] == refs
    bad = type("CBConfig", (), dict(block_size=0))()
    with pytest.raises(ValueError, match="continuous_batching_config: block_size"):
        hf_paged.generate_batch(model, prompts, GenerationConfig(max_new_tokens=2), bad)


def test_the_removed_background_compile_is_refused_with_the_values_that_remain():
    _, model = models("llama_gqa")
    with pytest.raises(ValueError, match=r"compile_layers must be True, False or None \(automatic\), got 'background'"):
        hf_paged.Engine(model, num_blocks=16, block_size=4, compile_layers="background")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        hf_paged.Engine(model, num_blocks=16, block_size=4, compile_layers=False).close()
