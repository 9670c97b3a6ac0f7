"""``fuse_all_reduce``: an inductor graph pass that folds a tensor-parallel layer's residual add and RMSNorm into the
all-reduce before them.

In a compiled decoder layer of a tensor-parallel model (``hf_paged.parallel._linears``), each rowwise linear's output is
summed over the ranks by ``hf_paged::tp_all_reduce``, an opaque op, and then added to the residual stream; after
attention the sum also feeds the next RMSNorm. Inductor cannot fuse into an opaque op, so each all-reduce is followed
by a small kernel of its own (the add, or the add and the norm): 64 per decode step of a 32-layer model, a few
microseconds each at 64 rows. Where peer_sum serves the group (``hf_paged.parallel._all_reduce``), this pass replaces

- ``residual + tp_all_reduce(x)`` followed by Llama's RMSNorm (``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)``
  in float32) by one ``hf_paged::tp_all_reduce_add_rms_norm`` call whose two outputs are the sum and its norm;
- ``residual + tp_all_reduce(x)`` with no such norm after it by one ``hf_paged::tp_all_reduce_add`` call.

peer_sum's kernel then does the add and the norm in the same launch as the sum. Any other shape of graph (another
norm, a bias after the all-reduce, an intermediate used elsewhere) is left as it is. In the engine's compiled layers
the attention function breaks the graph, so the attention module's all-reduce ends a graph of its own (its add and
norm are in the next one) unless dynamo resumes such a break in the calling frame: every compile of the layers
traces with dynamo's ``nested_graph_breaks`` where this torch has it (``compile._layers.DYNAMO_DEFAULTS``), and
attention modules that transformers routes through the ``kernels`` package's wrapper trace without it (its ``try``
block stops the resume: ``compile._kernel_funcs``), so that a layer's work after attention (o_proj and its
all-reduce, the residual add and norm, the MLP, its all-reduce and add) is one graph and both forms serve. Without it
only the MLP's all-reduce takes its residual add.

On two H200s it took 0.03 ms off the 4.35 ms decode step of an 8B-shaped model at batch 64, with the greedy tokens of
one GPU (docs/guides/multi_gpu.md). ``hf_paged.parallel._fuse_all_reduce.LayerPasses`` runs the engine's graph passes
(grouped linears, then this one, over the groups peer_sum serves) as the one custom pass inductor takes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hf_paged.compile._group_linears import _keep_meta, _val

_aten = torch.ops.aten
_CONVERT = torch.ops.prims.convert_element_type.default


def fuse_all_reduce(graph: torch.fx.Graph, ready: Callable[[str], bool]) -> int:
    """Replace, in place, each ``tp_all_reduce`` over a group that ``ready`` accepts (by name: one peer_sum serves)
    whose only use is an add to a tensor of its shape and dtype (and the RMSNorm of that sum, where one follows) by
    the fused op. Returns the number of fused calls made."""
    reduce = torch.ops.hf_paged.tp_all_reduce.default
    order = {node: i for i, node in enumerate(graph.nodes)}
    made = 0
    for node in list(graph.nodes):
        if node.target is not reduce or len(node.args) != 2 or node.kwargs:
            continue
        x, group = node.args
        if not isinstance(group, str) or not ready(group):
            continue
        add = _user(node, _aten.add.Tensor)
        residual = _other_operand(add, node)
        if not _like(residual, node) or not _like(add, node):
            continue
        norm = _rms_norm_of(add)
        if norm is not None and any(order.get(n, -1) >= order[add] for n in norm[:2] if isinstance(n, torch.fx.Node)):
            norm = None  # the weight or epsilon is computed after the add, where the fused call goes
        _replace(graph, node, add, x, residual, group, norm)
        made += 1
    return made


def _user(node: torch.fx.Node | None, target) -> torch.fx.Node | None:
    """``node``'s only user where it calls ``target``, else None."""
    users = list(node.users) if node is not None else []
    return users[0] if len(users) == 1 and users[0].target is target else None


def _other_operand(call: torch.fx.Node | None, node: torch.fx.Node):
    """The other operand of the binary ``call`` (``a + b``, ``a * b``: two arguments, no alpha), where ``node`` is
    one of its two; else None."""
    if call is None or call.kwargs or len(call.args) != 2 or node not in call.args or call.args[0] is call.args[1]:
        return None
    return call.args[1] if call.args[0] is node else call.args[0]


def _like(node, reference: torch.fx.Node) -> bool:
    """``node``'s value has ``reference``'s shape and dtype (so the add does not broadcast or promote)."""
    a, b = _val(node), _val(reference)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.dim() == b.dim()
            and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True)))  # no new guard


def _is_convert(node, dtype: torch.dtype) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is _CONVERT and len(node.args) == 2 and node.args[1] == dtype


def _only(nodes: list) -> torch.fx.Node | None:
    return nodes[0] if len(nodes) == 1 else None


def _rms_norm_of(h: torch.fx.Node):
    """``(weight, eps, out, chain)`` where ``h`` feeds Llama's RMSNorm (``out``, ``chain`` its intermediate nodes in
    graph order, each used only inside the norm; ``eps`` a number or a 0-d tensor node), else None."""
    dtype = _val(h).dtype
    up = h if dtype == torch.float32 else _only([u for u in h.users if _is_convert(u, torch.float32)])
    if up is None:
        return None
    square = _only([u for u in up.users if u.target is _aten.pow.Tensor_Scalar and u.args[1:] == (2,)])
    mean = _user(square, _aten.mean.dim)
    if (mean is None or len(mean.args) != 3 or mean.args[0] is not square
            or list(mean.args[1]) not in ([-1], [_val(h).dim() - 1]) or mean.args[2] is not True):
        return None
    plus = _user(mean, _aten.add.Tensor)
    eps = eps_convert = _other_operand(plus, mean)
    if _is_convert(eps, torch.float32):  # a float attribute that torch.compile passes as a 0-d tensor
        eps = eps.args[0]
    else:
        eps_convert = None
    value = _val(eps)
    if not ((isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point())
            or isinstance(eps, (int, float))):
        return None
    rsqrt = _user(plus, _aten.rsqrt.default)
    scaled = _user(rsqrt, _aten.mul.Tensor)
    if scaled is None or set(scaled.args) != {up, rsqrt} or (up is not h and set(up.users) != {square, scaled}):
        return None
    down = scaled if dtype == torch.float32 else _user(scaled, _CONVERT)
    if down is not scaled and not _is_convert(down, dtype):
        return None
    out = _user(down, _aten.mul.Tensor)
    weight = _other_operand(out, down)
    w = _val(weight)
    if not (isinstance(w, torch.Tensor) and w.dtype == dtype and w.dim() == 1
            and statically_known_true(w.shape[0] == _val(h).shape[-1])):
        return None
    chain = [n for n in (up if up is not h else None, square, mean, eps_convert, plus, rsqrt, scaled,
                         down if down is not scaled else None) if n is not None]
    if eps_convert is not None and len(eps_convert.users) != 1:
        chain.remove(eps_convert)  # used elsewhere too: kept
    return weight, eps, out, chain


def _replace(graph, reduce, add, x, residual, group, norm) -> None:
    """Put the fused call where ``add`` stands: ``tp_all_reduce_add``, or with ``norm`` (``_rms_norm_of``'s answer)
    ``tp_all_reduce_add_rms_norm``, whose two outputs take the uses of ``add`` and of the norm."""
    with graph.inserting_before(add):
        if norm is None:
            h = graph.call_function(torch.ops.hf_paged.tp_all_reduce_add.default, (x, residual, group))
            _keep_meta(h, add)
        else:
            weight, eps, out, chain = norm
            eps_value, eps_tensor = (0.0, eps) if isinstance(eps, torch.fx.Node) else (float(eps), None)
            fused = graph.call_function(torch.ops.hf_paged.tp_all_reduce_add_rms_norm.default,
                                        (x, residual, weight, eps_value, eps_tensor, group))
            _keep_meta(fused, add)
            fused.meta["val"] = (add.meta["val"], out.meta["val"])
            h, normed = (graph.call_function(operator.getitem, (fused, i)) for i in (0, 1))
            _keep_meta(h, add)
            _keep_meta(normed, out)
            out.replace_all_uses_with(normed)
            for node in (out, *reversed(chain)):
                graph.erase_node(node)
    add.replace_all_uses_with(h)
    graph.erase_node(add)
    graph.erase_node(reduce)
