"""``optimize_generate``'s decode steps (``hf_paged/generate/_decode_graphs.py``), driven on the CPU.

A stand-in replaces the runner's ``CudaGraphs``: "capturing" runs the step once (a real capture runs nothing, but a
paged decode step run twice on the same plan writes the same K/V to the same slots), and "replaying" runs the step
again on the graph's input buffers and writes its logits into the ones captured, as a replay writes its output
buffers, then takes back what the step's Python set on the cache (a replay runs no Python: the decode steps must set
it themselves). What these tests check is the keying, the buffers, the fallbacks and the output. The real capture
runs in ``tests/gpu/generate/test_compiled_generate_gpu.py``. The oracle is the model's compiled ``generate`` before
``optimize_generate``.
"""

from __future__ import annotations

import pytest
import torch
from compiled_generate import GREEDY, CountingBackend, compile_config
from tiny_models import EOS, PAD, left_padded_batch, make_models

import hf_paged
from hf_paged.generate import _decode_graphs as decode_graphs
from hf_paged.hf.compat import with_cache


class StandInGraphs:
    """The CudaGraphs of one cache's steps, on the CPU (see the module docstring)."""

    made: list = []

    def __init__(self, device, cache=None, fail: bool = False):
        self.steps, self.outputs, self.cache, self.fail = {}, {}, cache, fail
        self.captures = self.replays = 0
        StandInGraphs.made.append(self)

    def capture(self, steps, prepare=None, check=None):
        for key, step, warm in steps:
            if self.fail:
                raise RuntimeError("capture failed")
            self.captures += 1
            self.steps[key], self.outputs[key] = step, step()
        return None

    def replay(self, key):
        self.replays += 1
        before = self.cache._plan_used if self.cache is not None else None
        self.outputs[key].copy_(self.steps[key]())
        if self.cache is not None:
            self.cache._plan_used = before
        return self.outputs[key]

    def drop(self, key):
        self.steps.pop(key, None)
        self.outputs.pop(key, None)


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


def _graphed(model, cache=None, fail: bool = False) -> decode_graphs.DecodeSteps:
    """optimize_generate, with the stand-in graphs on CPU tensors."""
    hf_paged.optimize_generate(model)
    usual = type(model).get_compiled_call.__get__(model)
    StandInGraphs.made = []
    steps = decode_graphs.DecodeSteps(model, usual, None, skinny=False, devices=("cpu",),
                                      new_graphs=lambda device: StandInGraphs(device, cache, fail))
    model.get_compiled_call = steps.get_compiled_call
    return steps


@pytest.mark.slow  # a compile and a capture per case: seconds on a 2-core CPU
@pytest.mark.parametrize("arch", ["llama_gqa", pytest.param("gemma2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=9, **GREEDY),
    pytest.param(dict(do_sample=True, top_k=20, num_return_sequences=2, max_new_tokens=8, pad_token_id=PAD,
                      eos_token_id=EOS), marks=pytest.mark.slow),
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
    decode_steps = _graphed(model, cache)
    shapes = []  # the token ids' shape of every forward
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    outs = [_run(model, cache, b, seed, **kwargs) for seed, b in enumerate(batches)]
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    rows = {out.shape[0] for out in outs}  # (with num_return_sequences, each prompt's rows)
    prompts = {(n, b["input_ids"].shape[1]) for n, b in zip([out.shape[0] for out in outs], batches)}
    assert {shape for shape in shapes if shape not in prompts} == {(1, n) for n in rows}, "decode steps: one row"
    assert decode_steps.failure is None, decode_steps.failure
    (graphs,) = StandInGraphs.made  # one cache: one set of graphs
    assert graphs.captures == 2, "one graph per batch shape"
    assert graphs.replays == decode_steps.replays == (steps - 1) + steps + (steps - 1)


@pytest.mark.slow
def test_steps_that_cannot_be_replayed_run_transformers_compiled_call():
    """Output flags the graphs do not hold (hidden states) leave every step to transformers' compiled call."""
    model = make_models("llama_gqa", seed=0)[1]
    model.generation_config.compile_config = compile_config(CountingBackend(), fullgraph=True)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8, max_new_tokens=6,
                                         compileable=True)
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, output_hidden_states=True, **GREEDY)
    reference = _run(model, cache, _batch(2), **kwargs).sequences
    torch._dynamo.reset()
    decode_steps = _graphed(model)
    assert torch.equal(_run(model, cache, _batch(2), **kwargs).sequences, reference)
    assert StandInGraphs.made == [] and decode_steps.replays == 0


@pytest.mark.slow
def test_a_capture_that_fails_leaves_the_steps_to_transformers_compiled_call(caplog):
    """A step whose capture fails is run by transformers' compiled call, as every later one: the tokens stay, and the
    log says why."""
    model = make_models("llama_gqa", seed=0)[1]
    model.generation_config.compile_config = compile_config(CountingBackend(), fullgraph=True)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8, max_new_tokens=7,
                                         compileable=True)
    reference = _run(model, cache, _batch(2), max_new_tokens=7, **GREEDY)
    torch._dynamo.reset()
    decode_steps = _graphed(model, cache, fail=True)
    with caplog.at_level("WARNING", logger="hf_paged"):
        assert torch.equal(_run(model, cache, _batch(2), max_new_tokens=7, **GREEDY), reference)
    assert decode_steps.replays == 0 and "capture failed" in decode_steps.failure
    assert "replays no decode step" in caplog.text


def test_restore_removes_the_graphed_calls():
    model = make_models("llama_gqa", seed=0)[1]
    hf_paged.optimize_generate(model)
    assert isinstance(model.get_compiled_call.__self__, decode_graphs.DecodeSteps)
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
    decode_steps = _graphed(model, cache)
    _run(model, cache, _batch(2), max_new_tokens=6, **GREEDY)
    assert decode_steps.replays > 0 and len(decode_steps.graphs) == 1
    for graphs in StandInGraphs.made:  # the stand-in's steps close over the call's kwargs; a CUDA graph holds none
        graphs.cache, graphs.steps = None, {}
    StandInGraphs.made, decode_steps.new_graphs = [], None  # (the stand-in's factory holds the cache too)
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None, "a captured graph keeps the cache alive"
