"""CUDA-graph batch sizes and the engine's ``cuda_graphs`` switch where there is no GPU (CPU side of the graphs)."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import hf_paged
from hf_paged.engine.cuda_graphs import graph_batch_sizes
from engine_helpers import models, random_prompts


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 16, 17, 40, 256])
def test_graph_sizes_cover_every_batch_with_little_padding(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs and sizes[0] == 1
    for n in range(1, max_num_seqs + 1):
        size = next(s for s in sizes if s >= n)
        assert size - n < max(32, n)  # at most 31 padding rows past 32, at most doubling below
    if max_num_seqs == 256:
        assert len(sizes) == 13


def test_cuda_graphs_are_a_no_op_on_the_cpu():
    _, paged = models("llama_gqa")
    prompts = random_prompts(3, 4, 30, seed=5)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    on = hf_paged.Engine(paged, num_blocks=64, block_size=8, cuda_graphs=True)
    off = hf_paged.Engine(paged, num_blocks=64, block_size=8, cuda_graphs=False)
    assert on.graphs is None and on.stats()["cuda_graphs"] is None
    assert [o.token_ids for o in on.generate(prompts, config)] == [o.token_ids for o in off.generate(prompts, config)]
