"""device_map placement: each layer's KV goes where accelerate put the layer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import EOS, PAD, left_padded_batch, make_models

from hf_paged.hf.compat import with_cache
from hf_paged.integrations.accelerate import layer_devices, paged_cache_for


def test_devices_follow_the_device_map():
    _, paged = make_models("llama_gqa")
    paged.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "cpu"}
    assert layer_devices(paged) == [torch.device("cuda", 0), torch.device("cpu")]
    paged.hf_device_map = {"model": "cpu", "model.layers.1": "disk", "lm_head": "cpu"}
    with pytest.raises(ValueError, match="disk"):
        layer_devices(paged)


def test_cache_for_a_mapped_model_generates_like_eager():
    eager, paged = make_models("gpt2")
    paged.hf_device_map = {"": "cpu"}
    cache = paged_cache_for(paged, num_blocks=64, block_size=8)
    assert [k.device for k, _ in cache.pool.kv_caches] == [torch.device("cpu")] * 2
    batch = left_padded_batch([4, 19], torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    assert torch.equal(paged.generate(**with_cache(paged, cache, **batch), **greedy), eager.generate(**batch, **greedy))


def test_the_engine_places_each_layers_kv_by_the_device_map():
    """The engine reads the device map as paged_cache_for does (on the CPU every entry is the CPU; the two-GPU
    split is tests/gpu/integrations/test_split_model_gpu.py)."""
    import hf_paged
    from hf_paged.hf._placement import kv_devices

    _, paged = make_models("llama_gqa")
    paged.hf_device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                           "model.norm": "cpu", "lm_head": "cpu"}
    assert kv_devices(paged) == [torch.device("cpu")] * 2
    engine = hf_paged.Engine(paged, num_blocks=None, memory_budget=0.01, block_size=8)
    assert [k.device for k, _ in engine.runner.pool.kv_caches] == [torch.device("cpu")] * 2
    paged.hf_device_map = {"model": "cpu", "model.layers.1": "disk", "lm_head": "cpu"}
    with pytest.raises(ValueError, match="disk"):
        hf_paged.Engine(paged, num_blocks=16, block_size=8)
