"""Logits left sharded over a tensor-parallel group's vocabulary, for the engine's plain-greedy steps.

transformers shards a ``tp_plan="auto"`` model's ``lm_head`` by output rows and gathers the full logits on every rank
(Llama's ``colwise_gather_output``): at batch 64 of a 128k vocabulary that is 16 MiB of bf16 logits gathered over
the group and put in place every decode step. A plain-greedy step needs only each row's largest logit and its id.

:func:`install` puts a :class:`LocalLogits` in front of ``lm_head``'s ``forward``: inside the engine's model calls (and
the decode graphs they capture) it returns this rank's columns only, the local product. The engine then samples with
:class:`VocabShards`:

- every row plain greedy and no logprobs: :meth:`VocabShards.argmax`. Each rank takes its shard's largest logit and
  its id; the ranks exchange those ``(value, id)`` pairs (as a sum over the group in which each rank fills only its
  own slot, so peer_sum's one-shot kernel serves it where it serves the layers) and every rank picks the largest,
  the lowest id among equals, as ``argmax`` over the whole row does (a NaN counts as the largest, as there). The ids
  are those of the gathered logits, bit for bit: the values compared are the same bits. Every rank picks from the
  same exchanged bits, so the engine skips the broadcast of the leader's tokens after such a step.
- anything else (sampling, processors, logprobs): :meth:`VocabShards.gather` puts the full logits together first.

Outside the engine's calls (``model.generate``, any other caller) ``lm_head`` runs transformers' own path. Only an
``lm_head`` sharded evenly by output rows into a replicated output is taken; otherwise nothing is installed and the
engine samples the gathered logits as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hf_paged import _forward_context
from hf_paged.compile import _patches as patches
from hf_paged.parallel import _all_reduce as tp_all_reduce  # noqa: F401  (registers hf_paged::tp_all_reduce)
from hf_paged.parallel._linears import local_shards

_MAX_EXACT_ID = 1 << 24  # ids travel as float32 next to their values: exact up to here


@dataclass(frozen=True)
class VocabShards:
    """How the engine's logits are split: rank ``rank`` of ``world`` holds columns ``[rank * width, (rank + 1) *
    width)`` of a vocabulary of ``vocab`` (``world * width``) ids."""

    group: object
    rank: int
    world: int
    width: int
    vocab: int

    def sample(self, sampler, local: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """``sampler``'s ``(tokens, logprobs)`` for ``batch`` from ``[N, width]`` local logits, and whether every rank
        got the same tokens by construction: plain greedy rows without logprobs take :meth:`argmax` (every rank picks
        from the same exchanged bits, so the leader's broadcast is not needed); anything else samples the gathered
        logits."""
        if batch.rows is None and batch.masked_at is None and not batch.want_logprobs:
            return self.argmax(local), None, True
        return *sampler(self.gather(local), batch), False

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[N, width]`` local logits -> ``[N, vocab]``, every rank's columns in rank order."""
        parts = torch.empty((self.world, *local.shape), dtype=local.dtype, device=local.device)
        torch.distributed.all_gather(list(parts.unbind(0)), local.contiguous(), group=self.group)
        return parts.permute(1, 0, 2).reshape(local.shape[0], self.vocab)

    def argmax(self, local: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64: each row's argmax over the whole vocabulary (first maximum; a NaN is the largest), from
        ``[N, width]`` local logits, on the device, without a host sync."""
        values, ids = local.max(-1)  # (torch's max and argmax: the first NaN, else the first largest)
        pairs = torch.zeros(self.world, local.shape[0], 2, dtype=torch.float32, device=local.device)
        pairs[self.rank] = torch.stack((values.float(), ids.float()), -1)
        # each rank fills its own slot and zeros elsewhere, so the sum is the gather (x + 0 is x, bit for bit)
        everyone = torch.ops.hf_paged.tp_all_reduce(pairs.view(-1), self.group.group_name).view_as(pairs)
        return pick(everyone, self.width)


def pick(everyone: torch.Tensor, width: int) -> torch.Tensor:
    """``[W, N, 2]`` float32 (value, id within its shard) of each rank's shard maximum, ranks in vocabulary order,
    shards ``width`` ids wide -> ``[N]`` int64 ids over the whole vocabulary: the first rank holding a NaN, else the
    first holding the largest value (torch's argmax over ranks does exactly that)."""
    best = everyone[..., 0].argmax(0)
    return everyone[..., 1].gather(0, best[None])[0].long() + best * width


class LocalLogits:
    """``lm_head``'s ``forward``: transformers' own (``eager``) outside the engine's calls, this rank's columns (the
    local product) inside them."""

    def __init__(self, module: torch.nn.Linear, eager, shards: VocabShards):
        self.eager, self.shards = eager, shards
        self.weight, self.bias = local_shards(module)

    def __call__(self, *args, **kwargs):
        if not _forward_context.local_logits() or len(args) != 1 or kwargs:
            return self.eager(*args, **kwargs)
        return F.linear(args[0], self.weight, self.bias)


def install(model: torch.nn.Module, tp) -> VocabShards | None:
    """A :class:`LocalLogits` on ``model``'s ``lm_head`` (installed by the first engine that asks; it returns local
    columns only inside the model calls of engines that took it) and the :class:`VocabShards` the engine samples
    with; None where the head is not sharded so (the engine then samples gathered logits)."""
    if (head := getattr(model, "lm_head", None)) is None:
        return None
    if isinstance(local := patches.patch_of(head, "tp_logits"), LocalLogits):
        return local.shards
    if (shards := _shards_of(head, tp)) is None:
        return None
    patches.install(head, "tp_logits", lambda eager: LocalLogits(head, eager, shards))
    return shards


def _shards_of(head: torch.nn.Module, tp) -> VocabShards | None:
    """The split of ``head``'s output over ``tp``'s ranks where it is sharded evenly by output rows, into a
    replicated output (transformers' colwise style with a gathered output); else None."""
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(weight, DTensor):
        return None
    placements = weight.placements
    if len(placements) != 1 or not placements[0].is_shard() or placements[0].dim % 2 != 0:
        return None
    vocab, world = weight.shape[0], len(tp.ranks)
    if vocab % world or vocab >= _MAX_EXACT_ID or weight.to_local().shape[0] != vocab // world:
        return None
    bias = head.bias
    if bias is not None and (not isinstance(bias, DTensor) or bias.to_local().shape[0] != vocab // world):
        return None
    return VocabShards(tp.group, tp.rank, world, vocab // world, vocab)
