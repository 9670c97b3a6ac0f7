"""Whether a model runs tensor-parallel, over which processes, and how many KV heads each process's layers hold.

transformers shards a model loaded with ``tp_plan="auto"`` (under ``torchrun``) by turning the planned weights into
DTensors on a device mesh: a colwise key projection keeps the rows of ``num_key_value_heads / tp_size`` heads on
each process, and the attention layers compute those heads only. The KV pool must hold exactly them, so they are
read from the sharded key projections, never from the config (which keeps the global count).

One answer for the engine (pool size, lockstep between the ranks) and the cache for ``model.generate``
(``hf_paged.integrations.accelerate.paged_cache_for``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from hf_paged.cache._kv_pool import KVLayout
from hf_paged.hf._placement import decoder_layers

#: Names of the key projection in the attention modules hf_paged can read a shard from.
_KEY_PROJECTIONS = ("k_proj",)


@dataclass(frozen=True)
class TensorParallel:
    """The process group a tensor-parallel model's layers communicate over.

    Attributes:
        group: the mesh's group of the sharded dimension (NCCL on GPUs, gloo on the CPU).
        ranks: the global ranks of the group, in group order; ``ranks[0]`` leads (its sampled tokens are used).
        rank: this process's index in ``ranks``.
    """

    group: object
    ranks: tuple[int, ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        """The global rank of the group's first process."""
        return self.ranks[0]


def tensor_parallel(model: torch.nn.Module) -> TensorParallel | None:
    """The model's tensor-parallel group, or None for a model with no sharded weight (or a group of one)."""
    if (sharded := _first_sharded_weight(model)) is None:
        return None
    import torch.distributed as dist

    dim = next(i for i, p in enumerate(sharded.placements) if p.is_shard())
    group = sharded.device_mesh.get_group(dim)
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) < 2:
        return None
    return TensorParallel(group, ranks, dist.get_rank(group))


def kv_layout(model: torch.nn.Module) -> KVLayout:
    """The shape of the KV this process's layers produce: the config's, with this process's own KV heads under
    tensor parallel (the local rows of each layer's sharded key projection over ``head_dim``; the config's count
    where the projection is not sharded). Raises ``NotImplementedError`` when layers hold different numbers of
    heads."""
    layout = KVLayout.from_config(model.config)
    layers = decoder_layers(model)
    if layers is None or tensor_parallel(model) is None:
        return layout
    heads = set()
    for index, layer in enumerate(layers):
        weight = _key_projection_weight(layer)
        if weight is None:
            if any(_is_sharded(p) for p in layer.parameters()):
                raise NotImplementedError(
                    f"{type(model).__name__} is tensor-parallel but layer {index} has no key projection named "
                    f"{' or '.join(_KEY_PROJECTIONS)} to read its KV heads from; hf_paged serves tensor-parallel "
                    "models with separate q/k/v projections (Llama, Mistral, Qwen, Gemma, ...)")
            heads.add(layout.num_kv_heads)
            continue
        rows = weight.to_local().shape[0] if _is_sharded(weight) else weight.shape[0]
        if rows == 0 or rows % layout.head_dim:
            raise NotImplementedError(
                f"layer {index}'s key projection holds {rows} rows in this process, not whole heads of "
                f"{layout.head_dim}: the tensor-parallel size must divide num_key_value_heads "
                f"({layout.num_kv_heads})")
        heads.add(rows // layout.head_dim)
    if len(heads) > 1:
        raise NotImplementedError(f"the layers of {type(model).__name__} hold different numbers of KV heads "
                                  f"({sorted(heads)}); the KV pool holds one count for every layer")
    return dataclasses.replace(layout, num_kv_heads=heads.pop())


def _key_projection_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    return next((m.weight for name, m in layer.named_modules() if name.rpartition(".")[2] in _KEY_PROJECTIONS
                 and isinstance(getattr(m, "weight", None), torch.Tensor)), None)


def _first_sharded_weight(model: torch.nn.Module):
    """The first layer's sharded key projection (the model's own where it lists no layers), else its first sharded
    parameter; None if it has none."""
    layers = decoder_layers(model)
    keys = (_key_projection_weight(m) for m in (layers if layers is not None else [model]))
    return next((w for w in itertools.chain(keys, model.parameters()) if _is_sharded(w)), None)


def _is_sharded(param: torch.Tensor) -> bool:
    placements = getattr(param, "placements", None)  # a DTensor's; plain tensors have none
    return placements is not None and any(p.is_shard() for p in placements)
