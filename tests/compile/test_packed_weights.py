"""Sibling weights laid end to end (``hf_paged.compile._packed_weights``): the user's model keeps its parameters,
values, logits, ``save_pretrained`` output and training; groups that cannot be packed are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import VOCAB, make_config
from transformers import AutoModelForCausalLM

from hf_paged.compile._packed_weights import SIBLINGS, pack_siblings
from hf_paged.kernels import _skinny as skinny


def _model(name: str = "llama_gqa", **config) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = make_config(name)
    for key, value in config.items():
        setattr(cfg, key, value)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _groups(model: torch.nn.Module):
    for parent in model.modules():
        for names in SIBLINGS:
            if all(hasattr(parent, n) for n in names):
                yield [getattr(parent, n) for n in names]


def _packed(group) -> bool:
    biases = [m.bias for m in group]
    return skinny.packed_rows([m.weight for m in group], biases) is not None


def test_packing_keeps_the_parameters_values_and_logits(tmp_path):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    objects = {n: id(p) for n, p in model.named_parameters()}
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    layers = model.config.num_hidden_layers
    assert not any(_packed(g) for g in _groups(model))
    assert pack_siblings(model) == 2 * layers  # q/k/v and gate/up of each layer
    assert all(_packed(g) for g in _groups(model))
    assert pack_siblings(model) == 2 * layers  # again: found packed, nothing moves
    assert {n: id(p) for n, p in model.named_parameters()} == objects
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    model.save_pretrained(tmp_path)  # tensors sharing a storage without overlapping are saved apart
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(before[k], v) for k, v in reloaded.state_dict().items())


def test_a_packed_model_still_trains_like_an_unpacked_one():
    packed, apart = _model(), _model()
    pack_siblings(packed)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    for model in (packed, apart):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(ids, labels=ids).loss.backward()
        opt.step()
    for (name, a), b in zip(packed.named_parameters(), apart.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert all(_packed(g) for g in _groups(packed))  # the optimizer's in-place steps keep the layout


def test_biases_are_packed_with_their_weights():
    model = _model("qwen2")  # q/k/v with biases, gate/up without
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert pack_siblings(model) == 2 * model.config.num_hidden_layers
    attn = model.model.layers[0].self_attn
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    assert skinny.packed_rows([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], biases) is not None


@pytest.mark.parametrize("how", ["mixed-dtype", "one-bias", "meta"])
def test_a_group_that_cannot_be_packed_is_left_as_it_is(how: str):
    model = _model()
    attn = model.model.layers[0].self_attn
    if how == "mixed-dtype":
        attn.k_proj.to(torch.float64)
    elif how == "one-bias":
        attn.k_proj.bias = torch.nn.Parameter(torch.zeros(attn.k_proj.out_features))
    else:
        attn.k_proj.to("meta")
    pointers = [m.weight.data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert pack_siblings(model) == 2 * model.config.num_hidden_layers - 1  # all but this layer's q/k/v
    assert [m.weight.data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)] == pointers
    assert not _packed([attn.q_proj, attn.k_proj, attn.v_proj])


def test_a_group_with_no_room_for_its_move_stays_apart(monkeypatch):
    """The move holds a second copy of the group for a moment; out of memory, the group keeps its own storages
    (values and logits as before) and the others are packed."""
    model = _model()
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
    real_cat, calls = torch.cat, []

    def cat_out_of_memory(tensors, *args, **kwargs):
        calls.append(len(tensors))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no room")
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", cat_out_of_memory)
    assert pack_siblings(model) == 2 * model.config.num_hidden_layers - 1
    monkeypatch.undo()
    assert [_packed(g) for g in _groups(model)].count(False) == 1
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
