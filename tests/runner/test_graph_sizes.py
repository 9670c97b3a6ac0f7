"""CUDA-graph batch sizes and the engine's ``cuda_graphs`` switch where there is no GPU (CPU side of the graphs)."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import hf_paged
from hf_paged.runner._graph_sizes import SMALLEST_GRAPH, graph_batch_sizes, one_call_graph_sizes, sizes_for
from engine_helpers import models, random_prompts


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 16, 17, 40, 256])
def test_graph_sizes_cover_every_batch_with_little_padding(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max(max_num_seqs, 2) and sizes[0] == SMALLEST_GRAPH == 2
    for n in range(1, max_num_seqs + 1):
        size = next(s for s in sizes if s >= n)
        assert size - n < max(32, n)  # at most 31 padding rows past 32, at most doubling below
    if max_num_seqs == 256:
        assert len(sizes) == 12


def test_given_sizes_keep_those_up_to_the_engine_and_the_first_above_it():
    """A full batch pads up to the first given size that holds it, rather than running eager."""
    assert sizes_for([1, 2, 8, 16, 40], 40) == [1, 2, 8, 16, 40]
    assert sizes_for([16, 2, 8, 1], 6) == [1, 2, 8]
    assert sizes_for([2, 4], 1) == [2]
    assert sizes_for([1, 2], 8) == [1, 2]  # steps of more than two sequences run eager


def test_cuda_graphs_are_a_no_op_on_the_cpu():
    _, paged = models("llama_gqa")
    prompts = random_prompts(3, 4, 30, seed=5)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    on = hf_paged.Engine(paged, num_blocks=64, block_size=8, cuda_graphs=True)
    off = hf_paged.Engine(paged, num_blocks=64, block_size=8, cuda_graphs=False)
    assert on.runner.graphs is None and on.stats()["cuda_graphs"] is None
    assert [o.token_ids for o in on.generate(prompts, config)] == [o.token_ids for o in off.generate(prompts, config)]


def test_generate_batch_captures_only_the_sizes_its_call_can_reach(monkeypatch):
    """A one-call engine never runs more sequences at once than the call has (prompts x num_return_sequences) and
    captures on every call, so it captures powers of two up to that, the smaller ones on demand; a persistent
    engine or an EngineConfig given as it is keep every size (captured at start and at first use), an explicit
    size list is kept, and a config may ask for every size at start."""
    from hf_paged.engine import _generate_batch as module

    built = []
    real = module.Engine

    def recording(model, config, workload=None):
        engine = real(model, config=config, workload=workload)
        built.append(engine.config)  # what the engine resolved
        return engine

    monkeypatch.setattr(module, "Engine", recording)
    _, paged = models("llama_gqa")
    prompts = random_prompts(3, 4, 12, seed=6)
    greedy = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    out = hf_paged.generate_batch(paged, prompts, greedy)
    assert built[-1].cuda_graphs == (2, 3) and built[-1].max_num_seqs == 3  # the call's sequences
    assert built[-1].cuda_graph_capture == "on_demand"  # the count at start, the smaller sizes when needed
    sampled = GenerationConfig(max_new_tokens=3, do_sample=True, num_return_sequences=2, eos_token_id=None)
    hf_paged.generate_batch(paged, prompts, sampled)
    assert built[-1].cuda_graphs == (2, 4, 6)
    hf_paged.generate_batch(paged, prompts, greedy, persistent_manager=True)
    assert built[-1].cuda_graphs is True and built[-1].cuda_graph_capture == "first_use"
    assert built[-1].max_num_seqs == 256
    paged.__dict__.pop(module._KEPT)
    hf_paged.generate_batch(paged, prompts, greedy, hf_paged.EngineConfig())
    assert built[-1].cuda_graphs is True and built[-1].cuda_graph_capture == "first_use"
    many = random_prompts(40, 4, 8, seed=7)
    hf_paged.generate_batch(paged, many, greedy)
    assert built[-1].cuda_graphs == (2, 4, 8, 16, 32, 40)
    capped = type("C", (), {"max_requests_per_batch": 16})()
    hf_paged.generate_batch(paged, many, greedy, continuous_batching_config=capped)
    assert built[-1].cuda_graphs == (2, 4, 8, 16)  # 40 sequences, at most 16 at once
    listed = type("C", (), {"cuda_graphs": [2, 4]})()
    hf_paged.generate_batch(paged, prompts, greedy, continuous_batching_config=listed)
    assert built[-1].cuda_graphs == (2, 4) and built[-1].cuda_graph_capture == "on_demand"
    at_start = type("C", (), {"cuda_graph_capture": "start"})()
    hf_paged.generate_batch(paged, prompts, greedy, continuous_batching_config=at_start)
    assert built[-1].cuda_graphs == (2, 3) and built[-1].cuda_graph_capture == "start"
    hf_paged.generate_batch(paged, prompts[:1], greedy)
    assert built[-1].cuda_graphs == (2,) and built[-1].max_num_seqs == 1  # one sequence replays two rows
    off = type("C", (), {"cuda_graphs": False})()
    assert [o.generated_tokens for o in out.values()] == [
        o.generated_tokens for o in hf_paged.generate_batch(paged, prompts, greedy, continuous_batching_config=off).values()]
    assert built[-1].cuda_graphs is False


@pytest.mark.parametrize("n", [1, 2, 3, 64, 100, 256])
def test_one_call_sizes_are_powers_of_two_up_to_the_call(n):
    sizes = one_call_graph_sizes(n)
    assert sizes[0] == 2 and sizes[-1] == max(n, 2) and sizes == sorted(set(sizes))
    assert all(s & (s - 1) == 0 for s in sizes[:-1])
    assert len(sizes) == {1: 1, 2: 1, 3: 2, 64: 6, 100: 7, 256: 8}[n]
