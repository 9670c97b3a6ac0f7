"""``Engine(compile_layers=...)``: the model's non-attention work compiled (torch.compile, inductor's CPU backend here).

The compiled layers must give the engine's tokens, serve only the engine's own calls, and fall back to the eager
modules when the compiler fails. The GPU tests check the CUDA side (fused kernels inside the captured graphs).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import hf_paged
from engine_helpers import greedy_config, hf_greedy, random_prompts
from hf_paged import _compat
from hf_paged.compile import _layers as cl
from hf_paged.compile._group_linears import GroupLinears
from tiny_models import make_models


@pytest.fixture(scope="module")
def model():
    """A model of its own: compiled forwards stay installed on a model's modules for the process."""
    torch.manual_seed(0)
    return make_models("llama_gqa")[1]


def _count_compiled_calls(model, monkeypatch) -> list[int]:
    """Count calls that reached a compiled forward (any layer or base-model child)."""
    calls = [0]
    for module in model.modules():
        switch = module.__dict__.get("forward")
        if isinstance(switch, cl._Switch):
            def counting(*args, _compiled=switch.compiled, **kwargs):
                calls[0] += 1
                return _compiled(*args, **kwargs)
            monkeypatch.setattr(switch, "compiled", counting)
    return calls


@pytest.mark.slow
def test_compiled_layers_give_the_eager_tokens_and_serve_only_the_engine(model, monkeypatch):
    prompts = random_prompts(6, 3, 30, seed=3)
    refs = hf_greedy("llama_gqa", prompts, 8)
    eager = hf_paged.Engine(model, num_blocks=64, block_size=4, max_batch_tokens=32, compile_layers=False)
    assert [o.token_ids for o in eager.generate(prompts, greedy_config(8))] == refs
    assert eager.stats()["compiled_layers"] is False

    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, max_batch_tokens=32, compile_layers=True)
    calls = _count_compiled_calls(model, monkeypatch)
    outs = engine.generate(prompts, greedy_config(8))
    assert [o.token_ids for o in outs] == refs  # chunked prefill, mixed and decode steps all went through
    assert engine.stats()["compiled_layers"] is True
    layers = model.config.num_hidden_layers
    assert calls[0] >= engine.stats()["steps"] * layers  # every step ran every layer compiled

    # The same model called outside an engine runs its eager modules.
    calls[0] = 0
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts[0]]))
    assert calls[0] == 0
    # An engine that does not ask for them does not use them either.
    outs = hf_paged.Engine(model, num_blocks=64, block_size=4, compile_layers=False).generate(
        prompts[:2], greedy_config(4))
    assert calls[0] == 0 and [o.token_ids for o in outs] == [r[:4] for r in refs[:2]]


def test_a_compiler_failure_falls_back_to_the_eager_modules(monkeypatch, caplog):
    torch.manual_seed(0)
    model = make_models("llama_gqa")[1]
    prompts = random_prompts(4, 3, 20, seed=5)
    refs = hf_greedy("llama_gqa", prompts, 6)
    layers = cl.compiled_layers(model)
    failures = [0]

    def broken(*args, **kwargs):
        failures[0] += 1
        raise torch._dynamo.exc.TorchDynamoException("the compiler broke")

    for switch in (m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), cl._Switch)):
        monkeypatch.setattr(switch, "compiled", broken)
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, compile_layers=True)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        outs = engine.generate(prompts, greedy_config(6))
    assert [o.token_ids for o in outs] == refs  # the failed call reran eagerly, nothing lost
    assert failures[0] == 1  # then the compiled forwards were no longer tried
    assert not layers.enabled and "the compiler broke" in layers.failure
    assert engine.stats()["compiled_layers"] is False
    assert "runs them eagerly" in caplog.text
    # A later engine on the model does not try again; asked for compiled layers, it says why (and raises nothing).
    assert hf_paged.Engine(model, num_blocks=16, block_size=4, compile_layers=None).runner.compiled is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        assert hf_paged.Engine(model, num_blocks=16, block_size=4, compile_layers=True).runner.compiled is None
    assert ("runs the model's layers eagerly: an earlier compile failed (TorchDynamoException: the compiler broke)"
            in caplog.text)


def test_errors_of_the_model_itself_pass_through(model):
    """An error raised by the model's own code inside a compiled forward is raised as it is, not taken for a
    compiler failure (which would switch the compiled layers off)."""
    layers = cl.compiled_layers(model)

    class Boom(ValueError):
        pass

    def raising(*args, **kwargs):
        raise Boom("from the model")

    switch = model.model.layers[0].__dict__["forward"]
    original = switch.compiled
    switch.compiled = raising
    try:
        with layers.active(), pytest.raises(Boom):
            switch(torch.zeros(1, 1, model.config.hidden_size))
        assert layers.enabled
    finally:
        switch.compiled = original


def test_compile_layers_is_validated():
    with pytest.raises(ValueError, match=r"compile_layers must be True, False or None \(automatic\), got .yes."):
        hf_paged.EngineConfig(compile_layers="yes")


@pytest.mark.slow
def test_beside_cuda_graphs_a_one_token_step_runs_the_eager_modules(model, monkeypatch):
    """Where decode replays CUDA graphs (the smallest of two rows), a one-token step is rare (here a prompt cached up to
    its last token) and runs the eager modules rather than compile a shape of its own; without graphs (the CPU) it
    runs compiled. The tokens are the same either way."""
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, max_batch_tokens=32, compile_layers=True)
    assert engine.runner.graphs is None  # the CPU: decode of one sequence compiled
    prompt = random_prompts(1, 9, 9, seed=21)  # 9 tokens in blocks of 4: a repeat finds 8 of them cached
    first = engine.generate(prompt, greedy_config(1))
    calls = _count_compiled_calls(model, monkeypatch)
    # an engine with decode graphs, none of which serves this step (a one-token prefill step)
    engine.runner.graphs = SimpleNamespace(size_for=lambda seqs, num_tokens: None, stats=lambda: None)
    again = engine.generate(prompt, greedy_config(1))
    assert engine.stats()["prefix_cache_hit_tokens"] == 8  # the repeat's only step had one token
    assert calls[0] == 0 and again[0].token_ids == first[0].token_ids
    engine.runner.graphs = None
    third = engine.generate(prompt, greedy_config(1))
    assert calls[0] >= model.config.num_hidden_layers and third[0].token_ids == first[0].token_ids


@pytest.mark.slow
def test_steps_of_new_sizes_do_not_compile_again(model):
    """Compiled after two steps only, one that fills ``max_batch_tokens`` exactly (its input views as wide as the
    buffers) and one of a single token (a shape of its own): steps of any other token count, and a second engine,
    reuse those graphs; nothing compiles mid-run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # forget what the other tests compiled
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, max_batch_tokens=16, compile_layers=True)
    engine.generate(random_prompts(1, 16, 16, seed=7), greedy_config(2))  # a 16-token step, then a 1-token step
    graphs = counters["stats"]["unique_graphs"]
    prompts = random_prompts(5, 2, 23, seed=9)
    refs = hf_greedy("llama_gqa", prompts, 5)
    outs = engine.generate(prompts, greedy_config(5))
    other = hf_paged.Engine(model, num_blocks=64, block_size=4, max_batch_tokens=24, compile_layers=True)
    outs2 = other.generate(prompts, greedy_config(5))
    assert counters["stats"]["unique_graphs"] == graphs
    assert [o.token_ids for o in outs] == refs and [o.token_ids for o in outs2] == refs


@pytest.mark.slow
def test_the_decoder_layers_share_one_trace_whatever_the_depth(monkeypatch):
    """Every decoder layer runs the first layer's graphs: a model of 3 layers compiles as many as one of 1 (a layer's
    graphs hold nothing of its own, such as its index or a patch object on it, that dynamo would guard on), and both
    give the eager model's tokens. Traced without inductor (its code is not what is counted)."""
    from torch._dynamo.utils import counters

    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, options=None, **kwargs: compile(fn, backend="eager", **kwargs))
    prompts = random_prompts(1, 6, 6, seed=17)
    graphs = {}
    for depth in (1, 3):
        eager, paged = make_models("llama_gqa", seed=depth, num_hidden_layers=depth)
        want = eager.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=3)[0, 6:].tolist()
        torch._dynamo.reset()
        counters.clear()
        engine = hf_paged.Engine(paged, num_blocks=16, block_size=4, compile_layers=True)
        assert engine.generate(prompts, greedy_config(3))[0].token_ids == want  # a prefill step, then decode
        graphs[depth] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs[1] > 0 and graphs[3] == graphs[1], graphs


def test_a_model_without_decoder_layers_runs_eager_or_is_refused():
    """A model the engine can serve but whose layers it cannot find (no base model, no list of layers)."""
    from benchmarks.engine.overhead import StubModel

    stub = StubModel(vocab=300, max_rows=64)
    assert cl.compile_unsupported_reason(stub, any_device=True) == "no list of decoder layers found on the model"
    engine = hf_paged.Engine(stub, num_blocks=16, block_size=4)  # automatic: eager, no error
    assert engine.runner.compiled is None and engine.stats()["compiled_layers"] is False
    with pytest.raises(ValueError, match="compile_layers=True cannot be served: no list of decoder layers"):
        hf_paged.Engine(stub, num_blocks=16, block_size=4, compile_layers=True)


def test_the_layers_compile_with_the_passes_and_options_they_are_given():
    """Each compiled forward takes its model's LayerCompile: the grouped linears alone by default, a tensor-parallel
    model's fused all-reduces, Triton PDL (where inductor has it); every compile traces with dynamo's nested graph
    breaks where this torch has them, set only while the layers serve a call; the process's own inductor config is
    never changed."""
    import torch._inductor.config as inductor_config

    from hf_paged.parallel import _fuse_all_reduce as fusion

    plain = cl.LayerCompile()
    nested = "nested_graph_breaks" in torch._dynamo.config._config
    assert cl.DYNAMO_DEFAULTS == ({"nested_graph_breaks": True} if nested else {})
    assert type(plain.inductor_options()["post_grad_custom_pre_pass"]) is GroupLinears
    assert plain.dynamo == cl.DYNAMO_DEFAULTS
    tp = fusion.layer_compile("no-such-group")
    assert isinstance(tp.inductor_options()["post_grad_custom_pre_pass"], fusion.LayerPasses)
    assert ("triton.enable_pdl" in tp.inductor) == _compat.inductor_has_option(_compat.INDUCTOR_PDL)
    assert tp.dynamo == cl.DYNAMO_DEFAULTS
    before = getattr(inductor_config.triton, "enable_pdl", None)
    layers = cl.CompiledLayers(make_models("llama_gqa")[1], tp)
    assert layers.how is tp
    assert getattr(inductor_config.triton, "enable_pdl", None) == before
    if nested:
        outside = torch._dynamo.config.nested_graph_breaks
        with layers.active():
            assert torch._dynamo.config.nested_graph_breaks is True
        assert torch._dynamo.config.nested_graph_breaks == outside


