"""A model split over two GPUs with accelerate's ``device_map`` under the engine, ``generate_batch`` and ``generate``.

Each layer's KV must sit on its layer's GPU and the tokens must be those of the same weights on one GPU.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from accelerate import dispatch_model
from tiny_models import ARCHS, EOS, PAD, left_padded_batch, make_models
from transformers import GenerationConfig

import hf_paged
from hf_paged.hf.compat import with_cache
from hf_paged.integrations.accelerate import paged_cache_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


@pytest.fixture(scope="module")
def models():
    """The same float32 weights on cuda:0 alone and split: embedding and layers 0-1 on cuda:0, layers 2-3, the
    final norm and the head on cuda:1."""
    ARCHS["llama_gqa"][1]["num_hidden_layers"] = 4
    try:
        _, model = make_models("llama_gqa")
    finally:
        ARCHS["llama_gqa"][1]["num_hidden_layers"] = 2
    single = copy.deepcopy(model).to("cuda:0")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    split = dispatch_model(model, device_map=device_map)
    split.hf_device_map = device_map
    return single, split


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 150, (int(k),), generator=gen).tolist() for k in torch.randint(3, 40, (n,), generator=gen)]


def test_the_engine_serves_a_split_model_with_each_layers_kv_on_its_gpu(models, caplog):
    single, split = models
    prompts = _prompts(12, seed=0)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
    reference = hf_paged.Engine(single, num_blocks=256, block_size=8, max_batch_tokens=64).generate(prompts, config)
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        engine = hf_paged.Engine(split, num_blocks=256, block_size=8, max_batch_tokens=64)
    devices = [k.device for k, _ in engine.runner.pool.kv_caches]
    assert devices == [torch.device("cuda", 0)] * 2 + [torch.device("cuda", 1)] * 2
    outs = engine.generate(prompts, config)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert engine.stats()["cuda_graphs"] is None and "split over" in caplog.text
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_generate_batch_sizes_the_pool_on_every_gpu(models):
    single, split = models
    prompts = _prompts(8, seed=1)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    want = hf_paged.generate_batch(single, prompts, config)
    got = hf_paged.generate_batch(split, prompts, config)  # num_blocks from the free memory of both GPUs
    assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in want.values()]


def test_generate_on_a_split_model_with_its_cache(models):
    single, split = models
    batch = left_padded_batch([5, 17, 30], torch.Generator().manual_seed(2))
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    want = single.generate(**{k: v.to("cuda:0") for k, v in batch.items()}, **greedy)
    cache = paged_cache_for(split, num_blocks=64, block_size=8)
    got = split.generate(**with_cache(split, cache, **{k: v.to("cuda:0") for k, v in batch.items()}), **greedy)
    assert torch.equal(got.cpu(), want.cpu())
