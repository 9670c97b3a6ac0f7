"""``hf_paged.optimize_generate``: the compiled decode step of ``generate`` with planned masks and fewer guards.

The oracle is the same model's compiled ``generate`` before ``optimize_generate`` (bit-identical here: the eager
compile backend and the same arithmetic), which ``test_compiled_generate.py`` holds to eager hf_paged.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from compiled_generate import GREEDY, CountingBackend, compile_config
from tiny_models import EOS, PAD, left_padded_batch, make_models
from transformers import CompileConfig

import hf_paged
from hf_paged.compile._group_linears import GroupLinears
from hf_paged.generate import _adapter as adapter
from hf_paged.generate import _optimize as fast_generate
from hf_paged.hf.compat import with_cache


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _setup(arch: str, new_tokens: int):
    model = make_models(arch, seed=0)[1]
    gen = torch.Generator().manual_seed(1)
    batch = left_padded_batch(torch.randint(6, 20, (3,), generator=gen).tolist(), gen)
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8, max_new_tokens=new_tokens,
                                         compileable=True)
    return model, batch, cache


def _run(model, cache, batch, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return model.generate(**with_cache(model, cache, **batch), **kwargs)


class MaskCalls:
    """Counts the calls of transformers' ``create_masks_for_generate`` that optimize_generate's masks make, by
    whether the cache held the batch already (a decode step) or not (prefill)."""

    def __init__(self, monkeypatch):
        self.decode = self.prefill = 0
        usual = adapter.create_masks_for_generate

        def counted(*args, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if kwargs["inputs_embeds"].shape[1] == 1 and cache.get_seq_length() > 0:
                self.decode += 1
            else:
                self.prefill += 1
            return usual(*args, **kwargs)

        monkeypatch.setattr(adapter, "create_masks_for_generate", counted)


@pytest.mark.parametrize("arch", ["llama_gqa", pytest.param("gemma2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=10, **GREEDY),
    pytest.param(dict(do_sample=True, top_k=20, num_return_sequences=2, max_new_tokens=8, pad_token_id=PAD,
                      eos_token_id=EOS), marks=pytest.mark.slow),
], ids=["greedy", "sampling"])
def test_optimized_generate_gives_the_compiled_steps_tokens_without_transformers_mask_code(arch, kwargs,
                                                                                             monkeypatch):
    """The same tokens as the compiled step before optimize_generate, every decode step compiled in one graph,
    and transformers' mask code asked only for prefills and for the first decode step (which teaches the layout:
    gemma2's masks are one plan per layer type, llama's the plan alone)."""
    model, batch, cache = _setup(arch, kwargs["max_new_tokens"])
    before = CountingBackend()
    model.generation_config.compile_config = compile_config(before, fullgraph=False)
    reference = [_run(model, cache, batch, seed, **kwargs) for seed in (0, 1)]
    assert before.graphs == 1 and before.calls >= 2 * (kwargs["max_new_tokens"] - 2)

    torch._dynamo.reset()
    after = CountingBackend()
    model.generation_config.compile_config = compile_config(after, fullgraph=False)
    hf_paged.optimize_generate(model)
    calls = MaskCalls(monkeypatch)
    outs = [_run(model, cache, batch, seed, **kwargs) for seed in (0, 1)]
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    assert after.graphs == 1, "one graph for both calls' decode steps (no recompile between generate calls)"
    assert after.calls == before.calls, "every decode step ran compiled"
    assert calls.prefill == 2 and calls.decode == 1, "decode steps after the first skip transformers' masks"
    layout = model.create_masks_for_generate.layout
    if arch == "llama_gqa":
        assert layout == "plain"
    else:
        assert isinstance(layout, tuple) and set(layout) == {"sliding_attention", "full_attention"}


def test_a_step_that_is_not_a_compileable_decode_takes_the_usual_masks(monkeypatch):
    """A cache that is not compileable (generate then runs eagerly) never reaches the planned masks' direct path:
    transformers' mask function is not even asked (generate builds masks only for a compileable cache), and the
    tokens are eager hf_paged's."""
    model, batch, _ = _setup("llama_gqa", 6)
    eager_cache = hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8)
    reference = _run(model, eager_cache, batch, max_new_tokens=6, **GREEDY)
    hf_paged.optimize_generate(model)
    calls = MaskCalls(monkeypatch)
    assert torch.equal(_run(model, eager_cache, batch, max_new_tokens=6, **GREEDY), reference)
    assert calls.decode == 0 and model.create_masks_for_generate.layout is None


def test_optimize_sets_a_guard_filter_and_restore_undoes_everything():
    model = make_models("llama_gqa", seed=0)[1]
    mine = compile_config("eager")
    model.generation_config.compile_config = mine
    assert hf_paged.optimize_generate(model) is model
    config = model.generation_config.compile_config
    assert config.options["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    assert config.backend == "eager" and config._compile_all_devices and mine.options is None
    assert isinstance(model.create_masks_for_generate, adapter.PlannedMasks)
    hf_paged.optimize_generate(model, skip_module_guards=False)  # again: replaces, does not stack
    assert model.generation_config.compile_config.options is None
    assert hf_paged.restore_generate(model) is model
    assert model.generation_config.compile_config is mine
    for name in ("create_masks_for_generate", "generate", "get_compiled_call", "forward", "_hf_paged_patches"):
        assert name not in model.__dict__, name
    hf_paged.restore_generate(model)  # restoring twice changes nothing


def test_decode_linears_where_the_kernel_cannot_serve():
    """On the CPU the skinny kernel cannot serve: None leaves the linears alone, True says why and what to pass."""
    model = make_models("llama_gqa", seed=0)[1]
    hf_paged.optimize_generate(model)
    assert "post_grad_custom_pre_pass" not in model.generation_config.compile_config.options
    with pytest.raises(ValueError, match="decode_linears=True cannot be served: .*CUDA.*pass decode_linears=False"):
        hf_paged.optimize_generate(model, decode_linears=True)


def test_with_options_turns_reduce_overhead_into_its_cuda_graph_option():
    merged = fast_generate.with_options(CompileConfig(), {"guard_filter_fn": len})
    assert merged.mode is None and merged.options == {"triton.cudagraphs": True, "guard_filter_fn": len}
    assert fast_generate.with_options(CompileConfig(), {}).mode == "reduce-overhead"
    eager = fast_generate.with_options(CompileConfig(backend="eager", mode=None), {"guard_filter_fn": len})
    assert eager.options == {"guard_filter_fn": len} and eager.backend == "eager"
    with pytest.raises(ValueError, match="mode 'max-autotune' .* cannot take options"):
        fast_generate.with_options(CompileConfig(mode="max-autotune"), {"guard_filter_fn": len})


def test_grouping_passes_compare_equal_after_generate_deep_copies_them():
    """generate deep-copies its compile config each call and compiles again when the copy differs."""
    config = CompileConfig(mode=None, options={"post_grad_custom_pre_pass": GroupLinears()})
    assert copy.deepcopy(config) == config


def _freeze_seen_in_forwards(model) -> list[int]:
    """The collector's frozen object count at each forward of ``model`` (a hook that stays on)."""
    seen = []
    model.register_forward_pre_hook(lambda *_: seen.append(gc.get_freeze_count()))
    return seen


def test_generate_sets_the_collectors_old_objects_aside_for_the_call():
    """Under optimize_generate a generate call runs with what existed at its start frozen (a full collection in it
    walks only what the call made), the same tokens; after the call nothing stays frozen, and restore_generate
    takes it off."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    model, batch, cache = _setup("llama_gqa", 5)
    seen = _freeze_seen_in_forwards(model)
    reference = _run(model, cache, batch, max_new_tokens=5, **GREEDY)
    assert seen and set(seen) == {0}
    hf_paged.optimize_generate(model)
    seen.clear()
    try:
        out = _run(model, cache, batch, max_new_tokens=5, **GREEDY)
        assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
        assert torch.equal(out, reference)
        assert model.generate.__doc__ == type(model).generate.__doc__  # still reads as generate
    finally:
        gc.unfreeze()
    hf_paged.restore_generate(model)
    seen.clear()
    _run(model, cache, batch, max_new_tokens=5, **GREEDY)
    assert set(seen) == {0}


def test_a_deep_copy_of_an_optimized_model_generates_with_its_own_weights():
    """The frozen-heap generate holds its model: a deep copy's generate runs the copy, not the original."""
    model, batch, _ = _setup("llama_gqa", 4)
    hf_paged.optimize_generate(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.5)
    seen = _freeze_seen_in_forwards(twin)
    cache = lambda m: hf_paged.PagedAttentionCache(m.config, num_blocks=64, block_size=8)  # noqa: E731
    assert twin.generate.inner.__self__ is twin
    out = twin.generate(**with_cache(twin, cache(twin), **batch), max_new_tokens=4, **GREEDY)
    assert seen and not torch.equal(out, model.generate(**with_cache(model, cache(model), **batch), max_new_tokens=4,
                                                        **GREEDY))
