"""``optimize_generate``'s decode graphs (``hf_paged/generate/_decode_graphs.py``), driven on the CPU.

A stand-in replaces the CUDA graph capture: "capturing" runs the step once (a real capture runs nothing, but a
paged decode step run twice on the same plan writes the same K/V to the same slots), and "replaying" runs the
compiled call on the graph's input buffers and writes its logits into the output captured, as a replay writes its
output buffers; the Python the compiled forward runs around its graph is the real one each time, so what these
tests check is the keying, the buffers, the fallbacks and the residual-bytecode check. The real capture runs in
``tests/gpu/test_compiled_generate_gpu.py``. The oracle is the model's compiled ``generate`` before
``optimize_generate``.
"""

from __future__ import annotations

import pytest
import torch
from test_compiled_generate import GREEDY, CountingBackend, compile_config
from tiny_models import EOS, PAD, left_padded_batch, make_models

import hf_paged
from hf_paged.generate import _decode_graphs as decode_graphs
from hf_paged.hf.compat import with_cache


class StandInCapture:
    """Runs the compiled call where a graph would replay, and takes back what its Python around the graph set on
    the cache (a replay runs no Python: the graphs must set it themselves)."""

    def __init__(self, cache=None):
        self.cache = cache
        self.captures = self.replays = 0

    def __call__(self, run, device):
        self.captures += 1
        output = run()

        def replay():
            self.replays += 1
            before = self.cache.__dict__.copy() if self.cache is not None else None
            output.logits.copy_(run().logits)
            if before is not None:
                self.cache.__dict__.update(_plan_used=before["_plan_used"])

        return replay, output


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batch(rows: int, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return left_padded_batch(torch.randint(6, 20, (rows,), generator=gen).tolist(), gen)


def _run(model, cache, batch, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return model.generate(**with_cache(model, cache, **batch), **kwargs)


def _graphed(model, cache=None):
    """optimize_generate, with the stand-in capture on CPU tensors."""
    hf_paged.optimize_generate(model)
    usual = type(model).get_compiled_call.__get__(model)
    stand_in = StandInCapture(cache)
    model.get_compiled_call = decode_graphs.GraphedCalls(model, usual, capture=stand_in, devices=("cpu",))
    return stand_in


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2"])
@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=9, **GREEDY),
    dict(do_sample=True, top_k=20, num_return_sequences=2, max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS),
], ids=["greedy", "sampling"])
def test_replayed_steps_give_the_compiled_steps_tokens(arch, kwargs):
    """Two calls at one batch size and one at another: the tokens of the compiled step before optimize_generate,
    the first step of each batch shape compiled, the second captured, every later one replayed."""
    model = make_models(arch, seed=0)[1]
    model.generation_config.compile_config = compile_config(CountingBackend(), fullgraph=True)
    steps = kwargs["max_new_tokens"] - 1  # decode steps of a call (EOS is never drawn within these few tokens)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=128, block_size=8,
                                         max_new_tokens=kwargs["max_new_tokens"], compileable=True)
    batches = [_batch(3), _batch(3), _batch(2, seed=2)]
    reference = [_run(model, cache, b, seed, **kwargs) for seed, b in enumerate(batches)]
    torch._dynamo.reset()
    stand_in = _graphed(model, cache)
    outs = [_run(model, cache, b, seed, **kwargs) for seed, b in enumerate(batches)]
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    graphs = model.get_compiled_call.current
    assert graphs.failure is None, graphs.failure
    assert stand_in.captures == 2, "one graph per batch shape"
    assert stand_in.replays == graphs.replays == (steps - 1) + steps + (steps - 1)


def test_steps_that_cannot_be_replayed_run_transformers_compiled_call():
    """Output flags the graphs do not hold (hidden states) leave every step to transformers' compiled call."""
    model = make_models("llama_gqa", seed=0)[1]
    model.generation_config.compile_config = compile_config(CountingBackend(), fullgraph=True)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8, max_new_tokens=6,
                                         compileable=True)
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, output_hidden_states=True, **GREEDY)
    reference = _run(model, cache, _batch(2), **kwargs).sequences
    torch._dynamo.reset()
    stand_in = _graphed(model)
    assert torch.equal(_run(model, cache, _batch(2), **kwargs).sequences, reference)
    assert stand_in.captures == 0 and stand_in.replays == 0


def test_an_unknown_residual_keeps_transformers_compiled_call(monkeypatch, caplog):
    """A forward whose residual bytecode sets something the replay would not (here: the cache flag, taken off the
    known names) is never replayed, says why, and keeps its tokens."""
    model = make_models("llama_gqa", seed=0)[1]
    model.generation_config.compile_config = compile_config(CountingBackend(), fullgraph=True)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8, max_new_tokens=7,
                                         compileable=True)
    reference = _run(model, cache, _batch(2), max_new_tokens=7, **GREEDY)
    torch._dynamo.reset()
    monkeypatch.setattr(decode_graphs, "KNOWN_NAMES", decode_graphs.KNOWN_NAMES - {"_plan_used"})
    stand_in = _graphed(model)
    with caplog.at_level("INFO", logger="hf_paged"):
        assert torch.equal(_run(model, cache, _batch(2), max_new_tokens=7, **GREEDY), reference)
    assert stand_in.captures == 0
    assert "_plan_used" in model.get_compiled_call.current.failure
    assert "replays no decode step" in caplog.text


def test_residual_names_of_a_function_dynamo_never_compiled():
    assert decode_graphs.residual_names(lambda x: x) is None


def test_restore_removes_the_graphed_calls():
    model = make_models("llama_gqa", seed=0)[1]
    hf_paged.optimize_generate(model)
    assert isinstance(model.get_compiled_call, decode_graphs.GraphedCalls)
    hf_paged.restore_generate(model)
    assert "get_compiled_call" not in model.__dict__
    hf_paged.optimize_generate(model, graphs=False)
    assert "get_compiled_call" not in model.__dict__


def test_graphs_do_not_keep_a_cache_alive():
    """Graphs are kept per cache and go with it: a cache generate is done with is freed (its pool with it)."""
    import gc
    import weakref

    model = make_models("llama_gqa", seed=0)[1]
    model.generation_config.compile_config = compile_config(CountingBackend(), fullgraph=True)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8, max_new_tokens=6,
                                         compileable=True)
    stand_in = _graphed(model, cache)
    _run(model, cache, _batch(2), max_new_tokens=6, **GREEDY)
    assert stand_in.replays > 0 and model.get_compiled_call.current.graphs
    stand_in.cache = None
    for graphs in model.get_compiled_call.current.graphs.values():
        for graph in graphs.values():
            graph.replay = None  # the stand-in's replay closes over the call's kwargs; a CUDA graph holds none
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None, "a captured graph keeps the cache alive"
