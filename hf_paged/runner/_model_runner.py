"""``ModelRunner``: the model call that consumes a step plan (``runner/_step_plan.py``).

It sends the plan's int32 layout to the device in one copy, reads the attention metadata as views of it, and runs
the model with ``logits_to_keep`` set to the sampled positions only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from hf_paged._forward_context import forward_context
from hf_paged.attention._dispatch import Dispatcher
from hf_paged.attention._metadata import PagedMetadata
from hf_paged.attention._step import PagedStep
from hf_paged.cache._kv_pool import KVPool
from hf_paged.compile._layers import CompiledLayers
from hf_paged.runner._staging import StagingBuffer
from hf_paged.runner._step_plan import StepPlan


@contextmanager
def model_call(step: PagedStep, compiled: CompiledLayers | None, skinny: bool,
               local_logits: bool = False) -> Iterator[None]:
    """The context of the engine's own model calls: the step in the forward context, the skinny linear routing
    (``skinny``) and a tensor-parallel ``lm_head``'s local logits (``local_logits``: ``hf_paged.parallel._logits``)
    where asked, and the model's compiled layers where it has them."""
    with forward_context(step, skinny_linears=skinny, local_logits=local_logits), \
            compiled.active() if compiled is not None else nullcontext():
        yield


# The attention mask of every own call: an empty 4-D tensor, which transformers' mask code hands to the layers as a
# prepared mask without looking at it (hf_paged's attention ignores it: the step is in the forward context). Given
# no mask and no cache, that code would instead probe position_ids for packed sequences, a host sync in every step
# (the host would wait for the device, which asynchronous scheduling avoids).
_NO_MASK: dict[torch.device, torch.Tensor] = {}


def call_model(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``model``'s ``[N, vocab]`` logits for a packed step ``ids``/``positions`` (``[1, T]``): no cache object and
    no attention mask (the forward context holds the step)."""
    mask = _NO_MASK.get(ids.device)
    if mask is None:
        mask = _NO_MASK[ids.device] = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=ids.device)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False,
                logits_to_keep=logits_to_keep)
    return out.logits[0]


class ModelRunner:
    """Runs planned steps of ``model`` on ``pool`` (``dispatcher`` picks each layer's attention backend); input buffers
    hold ``max_tokens`` tokens on the device.

    ``compiled``: the model's compiled layers, which then serve its calls (``Engine(compile_layers=...)``), a
    one-token step only with ``compile_one_token`` (see there);
    ``skinny``: its calls run with the skinny linear routing on (``Engine(skinny_linear=...)``);
    ``local_logits``: a tensor-parallel ``lm_head`` returns this rank's vocabulary columns (``tp_logits.install``).
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, dispatcher: Dispatcher, max_tokens: int,
                 device: torch.device, max_seqs: int = 256, max_blocks_per_seq: int = 256,
                 compiled: CompiledLayers | None = None, skinny: bool = False, local_logits: bool = False):
        self.model = model
        self.local_logits = local_logits
        self.compiled = compiled
        # torch.compile specialises a one-token step into graphs of its own, a compile of every layer's code the first
        # time one comes. Where decode replays CUDA graphs (whose smallest has two rows), a step of one token runs
        # eagerly only now and then (a one-token prompt, a prompt cached up to its last token), so it takes the eager
        # modules rather than stall the engine for that compile; the engine sets this False when it has graphs.
        self.compile_one_token = True
        self.skinny = skinny
        self.pool, self.dispatcher = pool, dispatcher
        self.device = torch.device(device)
        self.output_device = None  # set by the engine for a model split over devices
        self.pad_logits = self.device.type == "cuda"  # plan_step(pad_logits=...): on a GPU (runner/_step_plan.py)
        # One int64 buffer: [ last sampled tokens (max_seqs) | ids | positions | slots (max_tokens each) ]. The
        # first part, at a fixed address, is where a step's in-flight ids are read from (CUDA graphs read it too);
        # the plan's int32 ids, positions and slots are widened into the rest in one copy, and a step with
        # in-flight ids gathers its ids from the whole buffer in one index_select. Flat, so a step's [1, t] views
        # are contiguous whatever t (as compiled layers expect: no new strides).
        self._max_seqs, self._max_tokens = max_seqs, max_tokens
        self._wide = torch.zeros(max_seqs + 3 * max_tokens, dtype=torch.int64, device=device)
        self.last_tokens = self._wide[:max_seqs]
        self._gathered_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._own_index = np.arange(max_seqs, max_seqs + max_tokens, dtype=np.int32)  # token i's id: entry S + i
        # On a GPU a plan's layout travels in one copy; on the CPU the plan's own tensors serve.
        self._staging = None
        if self.device.type == "cuda":
            self._staging = StagingBuffer(4 * max_tokens + 5 * max_seqs + 2 + max_seqs * max_blocks_per_seq, device)

    def _rows_to_keep(self, rows: torch.Tensor) -> torch.Tensor:
        """The sampled rows' indices, on the device of the hidden states they index (the base model's last
        module: another GPU when the model is split with a device map)."""
        rows = rows.long()
        return rows if self.output_device is None else rows.to(self.output_device, non_blocking=True)

    def _to_device(self, plan: StepPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """The plan's layout and segments on the device: one copy through pinned memory (none on the CPU). The
        token sources become indices into the runner's int64 buffer: row ``r`` of the last sampled tokens, or
        entry ``S + i`` (token ``i``'s own id) where the id is known on the host."""
        n, t = plan.layout.numel(), plan.num_tokens
        if self._staging is None:
            layout = plan.layout.clone() if plan.has_sources else plan.layout
        else:
            host = self._staging.host_array(n)
            host[:] = plan.layout.numpy()
        if plan.has_sources:
            src = (layout.numpy() if self._staging is None else host)[3 * t : 4 * t]
            np.copyto(src, self._own_index[:t], where=src < 0)
        if self._staging is not None:
            layout = self._staging.send(n)
        return layout, plan.segments(layout)

    def metadata(self, plan: StepPlan, seg: dict[str, torch.Tensor | None], slots: torch.Tensor) -> PagedMetadata:
        """The step's attention metadata from its segments on the device (``slots``: int64) and the plan's host
        fields: no host tensor ops."""
        return PagedMetadata(
            num_seqs=plan.num_seqs, num_tokens=plan.num_tokens, max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k, block_size=self.pool.block_size, phase=plan.phase,
            cu_seqlens_q=seg["cu_seqlens_q"], cu_seqlens_k=seg["cu_seqlens_k"], seq_lens_k=seg["seq_lens_k"],
            block_tables=seg["block_tables"], slot_mapping=slots, token_index=None, grid=(1, plan.num_tokens),
            has_padding_slots=plan.has_padding, single_token_prefix=plan.single_token_prefix,
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; returns ``[N, vocab]`` logits of the sampled rows (on the model's output device), computed
        for the plan's padded rows."""
        t, m = plan.num_tokens, self._max_tokens
        if t > m:
            raise ValueError(f"a step of {t} tokens exceeds the runner's {m} (max_batch_tokens)")
        layout, seg = self._to_device(plan)
        s = self._max_seqs
        ids, pos, slots = self._wide[s : s + t], self._wide[s + m : s + m + t], self._wide[s + 2 * m : s + 2 * m + t]
        self._wide[s:].view(3, m)[:, :t].copy_(layout[: 3 * t].view(3, t))  # int32 -> int64, one copy
        if seg["token_sources"] is not None:  # in-flight ids: the previous step's tokens, on the device
            ids = torch.index_select(self._wide, 0, seg["token_sources"], out=self._gathered_ids[:t])
        step = PagedStep(self.metadata(plan, seg, slots), self.pool, self.dispatcher)
        compiled = self.compiled if t > 1 or self.compile_one_token else None
        with model_call(step, compiled, self.skinny, self.local_logits):
            logits = call_model(self.model, ids.view(1, t), pos.view(1, t), self._rows_to_keep(seg["logits_indices"]))
        return logits[: plan.num_sampled]  # (the plan pads the rows: runner/_step_plan.py)
