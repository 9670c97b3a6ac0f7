"""Packing the colwise shards that read one input (q/k/v) end to end (``hf_paged.parallel._linears.pack_colwise``), on
one CPU process over gloo: the DTensors keep their shapes and values, only their storage moves; a packed group is
found packed again rather than moved; one product over the buffer equals the separate ones; groups that cannot be
packed (a bias missing, shards not given) stay where they are, and gate/up stay apart. The two-process engine test
(tests/parallel/test_tensor_parallel.py) checks that a real model's layers are served packed."""

from __future__ import annotations

import pytest
import torch

from hf_paged.parallel import _linears as tp_linears
from hf_paged.kernels import _skinny as skinny

GROUPS = {"attention": (("q_proj", 16), ("k_proj", 8), ("v_proj", 8))}
MLP = {"mlp": (("gate_proj", 20), ("up_proj", 20))}  # never packed: two products cost what one and its split copy do


@pytest.fixture
def mesh(single_process_group):
    from torch.distributed.tensor import init_device_mesh

    return init_device_mesh("cpu", (1,))


def sharded_module(mesh, group: str, bias: tuple[bool, ...]) -> torch.nn.Module:
    """A module holding the group's linears (input width 12) with colwise DTensor weights (and biases)."""
    from torch.distributed.tensor import DTensor, Shard

    parent = torch.nn.Module()
    for (name, n), b in zip({**GROUPS, **MLP}[group], bias):
        linear = torch.nn.Linear(12, n, bias=b)
        linear.weight = torch.nn.Parameter(DTensor.from_local(linear.weight.detach(), mesh, [Shard(0)]))
        if b:
            linear.bias = torch.nn.Parameter(DTensor.from_local(linear.bias.detach(), mesh, [Shard(0)]))
        setattr(parent, name, linear)
    return parent


def shards(parent, group: str, what: str = "weight") -> list:
    return [getattr(getattr(parent, name), what) for name, _ in {**GROUPS, **MLP}[group]]


@pytest.mark.parametrize("group", GROUPS)
def test_packing_moves_the_shards_and_biases_end_to_end_and_keeps_their_values(mesh, group: str):
    torch.manual_seed(0)
    with_bias = sharded_module(mesh, group, (True,) * len(GROUPS[group]))
    before = [t.full_tensor().clone() for t in shards(with_bias, group) + shards(with_bias, group, "bias")]
    assert skinny.packed_rows([t.to_local() for t in shards(with_bias, group)], [None] * len(before)) is None
    assert tp_linears.pack_colwise(with_bias, list(with_bias.children())) == 1
    after = [t.full_tensor() for t in shards(with_bias, group) + shards(with_bias, group, "bias")]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    weights = [t.to_local() for t in shards(with_bias, group)]
    biases = [t.to_local() for t in shards(with_bias, group, "bias")]
    assert skinny.packed_rows(weights, biases) is not None
    address = weights[0].data_ptr()
    assert tp_linears.pack_colwise(with_bias, list(with_bias.children())) == 1  # found packed, not moved again
    assert shards(with_bias, group)[0].to_local().data_ptr() == address
    x = torch.randn(5, 12)
    outs = skinny.linear_group(x, weights, biases)  # one product over the packed shards
    assert all(torch.allclose(o, torch.nn.functional.linear(x, w, b), atol=1e-6)
               for o, w, b in zip(outs, weights, biases))


@pytest.mark.parametrize("group", GROUPS)
def test_groups_that_cannot_be_packed_stay_where_they_are(mesh, group: str):
    mixed = sharded_module(mesh, group, (True, False, True)[:len(GROUPS[group])])  # a bias missing
    addresses = [t.to_local().data_ptr() for t in shards(mixed, group)]
    assert tp_linears.pack_colwise(mixed, list(mixed.children())) == 0
    assert [t.to_local().data_ptr() for t in shards(mixed, group)] == addresses
    plain = sharded_module(mesh, group, (False,) * len(GROUPS[group]))
    assert tp_linears.pack_colwise(plain, []) == 0  # not among the colwise shards given
    assert tp_linears.pack_colwise(plain, list(plain.children())) == 1


def test_every_packed_group_is_tested():
    assert tuple(tuple(name for name, _ in GROUPS[g]) for g in GROUPS) == tp_linears.PACKED_GROUPS


def test_gate_and_up_are_left_apart(mesh):
    mlp = sharded_module(mesh, "mlp", (False, False))
    addresses = [t.to_local().data_ptr() for t in shards(mlp, "mlp")]
    assert tp_linears.pack_colwise(mlp, list(mlp.children())) == 0
    assert [t.to_local().data_ptr() for t in shards(mlp, "mlp")] == addresses
    assert skinny.packed_rows([t.to_local() for t in shards(mlp, "mlp")], [None, None]) is None
