"""``GroupLinears``: an inductor graph pass that runs the skinny linears sharing an input as one grouped call.

In a decode step at batch 1 the small products of a layer are bound by launch latency more than by bytes: q, k and
v of Llama-3.2-1B are three launches of ~6 us for 12 MB. Where 2 to :data:`~hf_paged.kernels._skinny.MAX_GROUP`
``hf_paged::linear`` calls of a graph take the same input node (q/k/v after the input norm, gate/up after the
post-attention norm), the pass replaces them by one ``hf_paged::linear_group`` call and a ``getitem`` per output;
the op decides at run time between one kernel launch and one ``F.linear`` per weight, as the single op does.

Where the group's weights lie end to end in one buffer (a tensor-parallel rank's q/k/v shards, packed by
``hf_paged.parallel._linears``; the fake tensors of the graph's inputs keep their shared storage and offsets), the pass
puts one ``hf_paged::linear_packed`` call there instead, whose single output the graph slices into the members'
outputs as views: the grouped op would otherwise copy each output out of its one product (three copy kernels per
layer for q/k/v at 64 rows).

The engine's compiled layers hand the pass to inductor as ``post_grad_custom_pre_pass`` in their own
``torch.compile`` options (``hf_paged.compile._layers``), so other compiles in the process are untouched.
The pass sees the post-grad graph, where the custom ops are still whole nodes; its ``uuid`` hashes this file, so
inductor's FX graph cache tells graphs compiled with and without it (or with another version of it) apart.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from hf_paged import _compat
from hf_paged._compat import CustomGraphPass
from hf_paged.kernels import _skinny as skinny


class GroupLinears(CustomGraphPass):
    """Inductor's custom pass wrapper around :func:`group_linears`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_linears(graph)

    def uuid(self) -> bytes:
        return _compat.get_hash_for_files((__file__,))

    # Every instance does the same. generate deep-copies its compile config each call and compiles afresh when the
    # copy differs from the config it compiled with: equal passes keep its compiled step.
    def __eq__(self, other) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


def group_linears(graph: torch.fx.Graph) -> int:
    """Replace, in place, the ``hf_paged.linear`` calls of ``graph`` that share an input node by
    ``hf_paged.linear_group`` calls of up to ``MAX_GROUP`` weights each (of one dtype and K; calls whose weight or
    bias is computed after the first call of the group stay single). Returns the number of grouped calls made."""
    linear = torch.ops.hf_paged.linear.default
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.target is linear:
            x, weight, bias = _arguments(node)
            key = _weight_key(weight)
            if isinstance(x, torch.fx.Node) and key is not None:
                groups[(x, *key)].append(node)
    made = 0
    for calls in groups.values():
        while len(calls) >= 2:
            first, position = calls[0], {node: i for i, node in enumerate(graph.nodes)}
            # the grouped call goes where the first stands: the others' inputs must exist there
            ready = [c for c in calls[1:] if all(position[n] < position[first] for n in c.all_input_nodes)]
            members = [first] + ready[:skinny.MAX_GROUP - 1]
            calls = [c for c in calls[1:] if all(c is not m for m in members)]
            if len(members) >= 2:
                in_storage_order = _lie_end_to_end(members)
                _replace(graph, in_storage_order or members, members[0], packed=in_storage_order is not None)
                made += 1
    return made


_KEPT_META = ("val", "stack_trace", "nn_module_stack", "source_fn_stack", "original_aten", "from_node", "seq_nr")


def _arguments(node: torch.fx.Node, recorded: tuple[tuple, dict] | None = None) -> tuple:
    """``(x, weight, bias)`` of an ``hf_paged.linear`` call ``node``, or of its ``recorded`` ``(args, kwargs)``,
    whether passed by position or by name."""
    args, kwargs = recorded if recorded is not None else (node.args, node.kwargs)
    bound = dict(zip(("x", "weight", "bias"), args, strict=False), **kwargs)
    return bound["x"], bound["weight"], bound.get("bias")


def _weight_key(weight) -> tuple | None:
    """(K, dtype, device) of a weight node with a known static shape, else None (the call stays single)."""
    value = _val(weight)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not isinstance(value.shape[1], int):
        return None
    return value.shape[1], value.dtype, value.device


def _val(node):
    """The value a graph node's metadata records (a fake tensor, say); None for a constant argument or without one."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _keep_meta(new: torch.fx.Node, old: torch.fx.Node) -> None:
    """Copy ``old``'s value and source metadata (where it has them) to ``new``, the node that takes its place (the
    caller sets another value after)."""
    new.meta.update({k: old.meta[k] for k in _KEPT_META if k in old.meta})


def _lie_end_to_end(members: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The members in the order their weights lie in memory, where the weights (and biases: all None, or likewise)
    lie end to end in one storage (``skinny.end_to_end``), as the graph's fake inputs say (they keep the real inputs'
    shared storage and offsets); else None."""
    def values(nodes) -> list | None:
        vals = [_val(n) for n in nodes]
        return vals if all(isinstance(v, torch.Tensor) for v in vals) else None

    weights = values([_arguments(m)[1] for m in members])
    if weights is None:
        return None
    order = sorted(range(len(members)), key=lambda i: weights[i].storage_offset())
    if not skinny.end_to_end([weights[i] for i in order], True, _compat.same_storage):
        return None
    members = [members[i] for i in order]
    biases = [_arguments(m)[2] for m in members]
    if all(b is None for b in biases):
        return members
    bias_values = values(biases)
    return members if bias_values is not None and skinny.end_to_end(bias_values, False, _compat.same_storage) else None


def _replace(graph: torch.fx.Graph, members: list[torch.fx.Node], before: torch.fx.Node, packed: bool) -> None:
    """One call of ``members`` where ``before`` (the first of them in the graph) stands, with its metadata and the
    members' eager input values (the strides inductor keeps the inputs to, as the single calls had); each member's
    uses take its output instead: an item of ``hf_paged.linear_group``'s list, or where ``packed`` (the members in
    the order their weights lie in memory) a slice (a view) of ``hf_paged.linear_packed``'s one output."""
    op = torch.ops.hf_paged.linear_packed.default if packed else torch.ops.hf_paged.linear_group.default
    calls, outs = [_arguments(m) for m in members], [m.meta.get("val") for m in members]
    with graph.inserting_before(before):
        call = graph.call_function(op, (calls[0][0], [c[1] for c in calls], [c[2] for c in calls]))
        _keep_meta(call, before)
        eager = [m.meta.get("eager_input_vals") for m in members]
        if all(e is not None for e in eager):
            values = [_arguments(m, e) for m, e in zip(members, eager)]
            call.meta["eager_input_vals"] = ((values[0][0], [v[1] for v in values], [v[2] for v in values]), {})
        call.meta["val"] = outs
        if packed:
            with outs[0].fake_mode:  # the op's output: contiguous, the members' columns side by side
                call.meta["val"] = whole = torch.cat(outs, dim=-1)
        start = 0
        for i, (member, out) in enumerate(zip(members, outs, strict=True)):
            if packed:  # the member's columns of the one output
                dim = whole.dim() - 1
                item = graph.call_function(torch.ops.aten.slice.Tensor, (call, dim, start, start + out.shape[-1]))
                _keep_meta(item, member)
                with out.fake_mode:
                    item.meta["val"] = whole.narrow(dim, start, out.shape[-1])
                start += out.shape[-1]
            else:
                item = graph.call_function(operator.getitem, (call, i))
                _keep_meta(item, member)
            member.replace_all_uses_with(item)
    for member in members:
        graph.erase_node(member)
