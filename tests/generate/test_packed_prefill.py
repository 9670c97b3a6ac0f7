"""``optimize_generate``'s packed prefill (``hf_paged/generate/_packed_prefill.py``), driven on the CPU.

The oracle is the same weights with eager attention and transformers' own cache (``generate``'s first-step logits
and its tokens, fp32). Each test also checks which path ran: the prompt forward reaches the embedding as one row of
the real tokens, or, for a call the packed path does not serve, as the padded grid.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from compiled_generate import GREEDY
from transformers import DynamicCache
from tiny_models import left_padded_batch, make_models

import hf_paged
from hf_paged.generate._packed_prefill import PackedPrefill
from hf_paged.hf.compat import with_cache


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _optimized(model) -> PackedPrefill:
    """optimize_generate on ``model``, its packed prefill serving CPU tensors."""
    hf_paged.optimize_generate(model)
    packed = model.__dict__["forward"]
    assert isinstance(packed, PackedPrefill)
    packed.devices = ("cpu",)
    return packed


class EmbeddingShapes:
    """The shapes of the token ids the model's embedding gets, one per forward."""

    def __init__(self, model):
        self.shapes = []
        model.get_input_embeddings().register_forward_pre_hook(lambda module, args: self.shapes.append(
            tuple(args[0].shape)))


def _cache(model, compileable: bool, new_tokens: int):
    return hf_paged.PagedAttentionCache(model.config, num_blocks=64, block_size=8,
                                        max_new_tokens=new_tokens if compileable else None,
                                        compileable=True if compileable else False)


def _generate(model, batch, cache=None, **kwargs):
    inputs = batch if cache is None else with_cache(model, cache, **batch)
    return model.generate(**inputs, return_dict_in_generate=True, output_logits=True, **GREEDY, **kwargs)


@pytest.mark.parametrize("arch", ["llama_gqa", "mistral", "qwen3", pytest.param("gemma2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("compileable", [False, True], ids=["2d-mask", "planned-mask"])
@pytest.mark.parametrize("lengths", [[5, 30, 12, 19], [9, 9]], ids=["padded", "no-padding"])
def test_the_prompt_forward_runs_packed_and_gives_the_eager_models_logits(arch, compileable, lengths):
    """Rows of several lengths (past mistral's and gemma2's sliding windows), a cache that takes the padding mask
    (the step planned by the packed path) or one that makes generate plan it first: one forward of ``[1, T]``
    real tokens, the first step's logits and every token of the eager model."""
    eager, paged = make_models(arch, seed=3)
    batch = left_padded_batch(lengths, torch.Generator().manual_seed(len(lengths)))
    want = _generate(eager, batch, max_new_tokens=6)
    packed = _optimized(paged)
    shapes = EmbeddingShapes(paged)
    got = _generate(paged, batch, _cache(paged, compileable, 6), max_new_tokens=6)
    assert packed.packed == 1
    assert shapes.shapes[0] == (1, sum(lengths)), "the prompt forward ran on the padded grid"
    assert all(shape == (len(lengths), 1) for shape in shapes.shapes[1:])
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences, want.sequences)


def test_a_chunked_prefill_runs_each_chunk_packed_and_leaves_a_row_without_new_tokens_to_the_usual_forward():
    """``prefill_chunk_size``: later chunks run on a cache that holds the earlier ones (positions continue from
    there); the first chunk of a row that is all padding there has no token to give logits for, so that forward
    runs on the padded grid."""
    eager, paged = make_models("llama_gqa", seed=5)
    batch = left_padded_batch([10, 20, 14], torch.Generator().manual_seed(5))  # 20 columns, chunks of 8
    want = _generate(eager, batch, max_new_tokens=5)
    packed = _optimized(paged)
    shapes = EmbeddingShapes(paged)
    got = _generate(paged, batch, _cache(paged, False, 5), max_new_tokens=5, prefill_chunk_size=8)
    # chunk 1 (columns 0-7): the 10-token row is all padding there; chunks 2 and 3 packed
    assert shapes.shapes[:3] == [(3, 8), (1, 6 + 8 + 8), (1, 4 * 3)]
    assert packed.packed == 2
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences, want.sequences)


def test_beam_search_and_several_returned_sequences_run_the_expanded_rows_packed():
    eager, paged = make_models("llama_gqa", seed=11)
    batch = left_padded_batch([7, 16], torch.Generator().manual_seed(11))
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2)
    want = eager.generate(**batch, **GREEDY, **kwargs)
    packed = _optimized(paged)
    shapes = EmbeddingShapes(paged)
    got = paged.generate(**with_cache(paged, _cache(paged, False, 5), **batch), **GREEDY, **kwargs)
    assert packed.packed == 1 and shapes.shapes[0] == (1, 3 * (7 + 16))
    assert torch.equal(got, want)


@pytest.mark.parametrize("call", ["hidden states", "inputs_embeds", "dynamic cache", "off the served devices",
                                  "one row"])
def test_calls_it_does_not_serve_run_the_model_as_before(call):
    """Output flags, embeddings in place of ids, another cache, a device not served, a batch of one row: the usual
    forward, the same results."""
    eager, paged = make_models("llama_gqa", seed=7)
    batch = left_padded_batch([11] if call == "one row" else [4, 11], torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=4)
    if call == "hidden states":
        kwargs["output_hidden_states"] = True
    if call == "inputs_embeds":
        batch = {"inputs_embeds": eager.get_input_embeddings()(batch["input_ids"]),
                 "attention_mask": batch["attention_mask"]}
    want = _generate(eager, batch, **kwargs)
    packed = _optimized(paged)
    if call == "off the served devices":
        packed.devices = ("cuda",)
    cache = DynamicCache(config=paged.config) if call == "dynamic cache" else _cache(paged, False, 4)
    got = _generate(paged, batch, cache, **kwargs)
    assert packed.packed == 0
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences[:, -4:], want.sequences[:, -4:])


def test_a_forward_without_positions_runs_as_before():
    """A direct forward of a padded batch with no ``position_ids`` counts the padding columns as positions (the
    model's own rule): the packed path, which takes generate's positions, leaves it alone."""
    _, paged = make_models("llama_gqa", seed=13)
    batch = left_padded_batch([4, 9], torch.Generator().manual_seed(13))

    def forward():
        cache = _cache(paged, False, 1)
        return paged(**with_cache(paged, cache, **batch), logits_to_keep=1).logits

    want = forward()
    packed = _optimized(paged)
    got = forward()
    assert packed.packed == 0
    assert torch.equal(got, want)


def test_a_model_whose_class_makes_its_own_masks_keeps_its_prompt_forward(monkeypatch):
    _, paged = make_models("llama_gqa", seed=9)
    monkeypatch.setattr(type(paged), "create_masks_for_generate", lambda self, **kwargs: None, raising=False)
    hf_paged.optimize_generate(paged)
    assert "forward" not in paged.__dict__
    hf_paged.restore_generate(paged)


def test_generate_reads_the_models_own_forward_signature_and_restore_takes_the_packed_forward_away():
    _, paged = make_models("llama_gqa", seed=9)
    before = inspect.signature(paged.forward)
    _optimized(paged)
    assert inspect.signature(paged.forward) == before
    hf_paged.restore_generate(paged)
    assert "forward" not in paged.__dict__
    hf_paged.optimize_generate(paged, packed_prefill=False)
    assert "forward" not in paged.__dict__
    # a forward set on the instance before (a wrapper, an accelerate hook) is wrapped, then given back
    own = paged.forward
    paged.forward = own
    hf_paged.optimize_generate(paged)
    assert paged.__dict__["forward"].inner is own
    hf_paged.restore_generate(paged)
    assert paged.__dict__["forward"] is own
