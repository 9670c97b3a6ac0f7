"""``WeightWatch``: whether the model's weights changed since the engine's KV was computed with them.

The KV in the pool holds for the weights it was computed with. An in-place change of a parameter (an optimizer step,
``load_state_dict``, ``param.copy_(...)``) raises its version counter, which each step compares
(:meth:`WeightWatch.changed`, a sum over the parameters); :meth:`WeightWatch.check` finds the rest, once per call of
``generate_batch``: values written through ``param.data`` (a sample of every parameter's values compared), parameters
replaced or moved to another dtype or device (their storages compared).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from hf_paged import _compat


class WeightWatch:
    """The parameters of ``model`` as the KV is computed with them: their version counters, storages and a sample of
    their values (views, which see every later write to them)."""

    def __init__(self, model: torch.nn.Module):
        _count_optimizer_steps()
        self.model = model
        self.params = list(model.parameters())
        self.stale = False  # the KV is to be forgotten whatever the counters say (reset_prefix_cache(), check())
        self._storages = _storages(self.params)
        self._views = _sample_views(self.params)
        self.settle()

    def changed(self) -> bool:
        """Whether the KV is to be forgotten: marked stale, or a parameter changed in place since :meth:`settle`."""
        return self.stale or _compat.version_sum(self.params) != self._counted

    def settle(self) -> None:
        """The weights as they are now are those the KV is computed with (the KV was just forgotten)."""
        self._counted = _compat.version_sum(self.params)
        self._sample = _weight_sample(self._views)
        self.stale = False

    def check(self) -> bool:
        """Compare the storages and the sample (see ``EngineCore.check_weights``): False where a parameter was
        replaced or its storage, dtype or device changed; else True, marked stale where a sampled value changed."""
        if _storages(self.model.parameters()) != self._storages:
            return False
        if not all(map(torch.equal, _weight_sample(self._views), self._sample)):
            self.stale = True  # (a NaN weight counts as changed at every call: correct, if slower)
        return True


@cache
def _count_optimizer_steps() -> None:
    """Make every optimizer step raise the version counters of the parameters it updates, once per process.

    torch's fused optimizer kernels (``torch._fused_adamw_``, ``_fused_sgd_``, ...: ``fused=True``, the Trainer's
    default ``adamw_torch_fused``) write the parameters without raising their version counters, as the other in-place
    ops (the foreach ones included) do: the engine's per-step check would not see the step. A global hook after each
    ``torch.optim.Optimizer.step`` (any subclass, fused or not) raises the counters of the optimizer's parameters,
    about a microsecond each."""
    register_optimizer_step_post_hook(_stepped)


def _stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            torch.autograd.graph.increment_version(param)


def _storages(params: Iterable[torch.Tensor]) -> list[tuple]:
    """Each parameter (its id: the watch holds those it took, so an id is never another's) with its storage, dtype
    and device."""
    return [(id(p), p.data_ptr(), p.dtype, p.device) for p in params]


def _sample_views(params: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """Per device, a flat view of about 64 entries of each parameter there, evenly spread (of a non-contiguous one,
    along its first dimension): its local shard under tensor parallel; none of a parameter without storage (meta)."""
    views: dict[torch.device, list[torch.Tensor]] = {}
    for param in params:
        local = _compat.dtensor_local_tensor(param)
        t = (param if local is None else local).detach()
        if t.device.type == "meta" or not t.numel():
            continue
        view = t.view(-1)[:: -(-t.numel() // 64)] if t.is_contiguous() else t[
            (slice(None, None, -(-t.shape[0] // 64)),) + (0,) * (t.dim() - 1)]
        views.setdefault(t.device, []).append(view)
    return views


def _weight_sample(views: dict[torch.device, list[torch.Tensor]]) -> list[torch.Tensor]:
    """The sampled values, copied into one tensor per device."""
    return [torch.cat(vs) for vs in views.values()]
