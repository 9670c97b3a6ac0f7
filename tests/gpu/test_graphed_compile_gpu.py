"""On the GPU: ``generate(compile_config=hf_paged.compile_config())`` captures each compiled decode step into a
plain CUDA graph, replays it for every later step, and gives eager's greedy tokens up to bf16 rounding ties (the
rule of ``test_end_to_end_gpu.py``) and the tokens of transformers' own compiled path (graph trees) on the same
cache settings."""

from __future__ import annotations

import pytest
import torch
from test_compiled_generate_gpu import GREEDY, RUNS, compileable_cache
from test_end_to_end_gpu import NEW_TOKENS, assert_matches_up_to_ties, batch, eager_run, models  # noqa: F401

import hf_paged
from hf_paged.hf.compat import with_cache


def _generate(model, cache, inputs, config, **extra):
    return model.generate(**with_cache(model, cache, **inputs), max_new_tokens=NEW_TOKENS, compile_config=config,
                          **GREEDY, **extra)


@pytest.mark.cuda
@pytest.mark.parametrize("allowed, block_size", RUNS)
def test_graphed_generate_matches_eager_and_replays_one_capture(models, batch, eager_run, allowed, block_size):
    paged = models[1]
    torch._dynamo.reset()
    config = hf_paged.compile_config()
    cache = compileable_cache(paged, batch, allowed, block_size)
    outs = [_generate(paged, cache, batch, config) for _ in range(2)]
    (graph,) = config.backend.graphs
    assert graph.failure is None, graph.failure
    assert graph.captures == 1, "one capture serves every decode step of both calls"
    width = batch["input_ids"].shape[1]
    label = f"graphed generate {allowed} bs={block_size}"
    assert torch.equal(outs[0], outs[1])
    assert_matches_up_to_ties(outs[0][:, width:], *eager_run, label)
    # a new cache of the same shape: its pool lives elsewhere, so the step is captured again
    again = _generate(paged, compileable_cache(paged, batch, allowed, block_size), batch, config)
    assert graph.captures == 2 and torch.equal(again, outs[0])
    torch._dynamo.reset()
    trees = _generate(paged, compileable_cache(paged, batch, allowed, block_size), batch, None)
    same = int((trees == outs[0]).all(1).sum())
    print(f"{label}: {same}/{outs[0].shape[0]} rows equal to the graph-trees compiled path")
    assert_matches_up_to_ties(trees[:, width:], *eager_run, label + " (graph trees)")


@pytest.mark.cuda
def test_hidden_states_of_every_step_survive_the_next_replay(models, batch):
    """``output_hidden_states``: generate keeps each step's hidden states; a replay must not overwrite them."""
    paged = models[1]
    torch._dynamo.reset()
    config = hf_paged.compile_config()
    extra = dict(return_dict_in_generate=True, output_hidden_states=True)
    got = _generate(paged, compileable_cache(paged, batch, ("cuda", "torch"), 16), batch, config, **extra)
    want = _generate(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=512, block_size=16, device="cuda",
                                                          dtype=torch.bfloat16, backend=("cuda", "torch")),
                     batch, None, **extra)
    assert config.backend.graphs and config.backend.graphs[0].captures == 1
    steps = min(len(got.hidden_states), len(want.hidden_states))
    same_tokens = (got.sequences == want.sequences).all(1)
    for s in range(1, steps):
        g, w = got.hidden_states[s][-1][same_tokens], want.hidden_states[s][-1][same_tokens]
        torch.testing.assert_close(g.float(), w.float(), atol=0.1, rtol=0.05, msg=f"decode step {s}")
    assert not torch.equal(got.hidden_states[1][-1], got.hidden_states[2][-1])
