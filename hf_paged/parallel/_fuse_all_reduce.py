"""How a tensor-parallel model's layers compile: the grouped linears, then the all-reduces fused with their residual
add and RMSNorm (``hf_paged.compile._fuse_all_reduce``) over the groups peer_sum serves."""

from __future__ import annotations

import torch

from hf_paged import _compat, envs
from hf_paged.compile import _fuse_all_reduce as fusion
from hf_paged.compile._group_linears import GroupLinears, group_linears
from hf_paged.compile._layers import LayerCompile
from hf_paged.parallel import _all_reduce as tp_all_reduce


def layer_compile(group_name: str) -> LayerCompile:
    """How the layers of a tensor-parallel model over the group named ``group_name`` compile: the all-reduces fused
    with their residual add and norm after the grouped linears (:class:`LayerPasses`), and the Triton kernels with
    programmatic dependent launch where inductor has it (0.14 ms off a 5.45 ms 8B decode step on two H100s, with the
    sharded logits)."""
    inductor = {_compat.INDUCTOR_PDL: True} if _compat.inductor_has_option(_compat.INDUCTOR_PDL) else {}
    return LayerCompile(LayerPasses(), inductor)


class LayerPasses(GroupLinears):
    """The engine's compiled layers' custom pass: :func:`~hf_paged.compile._group_linears.group_linears`, then
    :func:`~hf_paged.compile._fuse_all_reduce.fuse_all_reduce` where peer_sum serves the group (equal instances, as
    GroupLinears'). Its ``uuid`` keys inductor's FX graph cache by the all-reduce chosen as well."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_linears(graph)
        fusion.fuse_all_reduce(graph, tp_all_reduce.fused_ready)

    def uuid(self) -> bytes:
        return (super().uuid() + _compat.get_hash_for_files((__file__, fusion.__file__)) + b"fuse:"
                + envs.tp_all_reduce().encode())
