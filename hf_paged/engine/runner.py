"""The step plan (flat integer tensors from the scheduler's choice) and the model call that consumes it.

``plan_step`` is pure: it reads the scheduled sequences and the block-table buffer and returns a :class:`StepPlan`,
built with vectorised tensor ops (per-sequence Python work only, never per token). ``ModelRunner`` copies a plan
into fixed-capacity device buffers (the layout decode CUDA graphs will capture), hands the attention metadata to the
cache and runs the model with ``logits_to_keep`` set to the sampled positions only.
"""

from __future__ import annotations

from array import array
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from hf_paged.attention.metadata import MetadataBuffers, PagedMetadata, build_metadata
from hf_paged.cache.paged_cache import PagedAttentionCache
from hf_paged.engine.compiled_layers import CompiledLayers
from hf_paged.engine.block_table_buffer import BlockTableBuffer
from hf_paged.engine.sequence import Sequence
from hf_paged.hf.compat import cache_keyword


@dataclass(frozen=True)
class StepPlan:
    """One step as host tensors (``T`` tokens of ``B`` sequences, ``N`` sampled rows).

    Integer tensors are int64 on the host (no conversions while planning); the device copies the attention
    metadata holds are int32 (``build_metadata``).

    Attributes:
        input_ids, position_ids: ``[T]``.
        slot_mapping: ``[T]`` physical slot ``block * block_size + offset``; -1 = padding token (no write).
        q_lens, seq_lens_k: ``[B]`` new tokens / context length after the step.
        block_tables: ``[B, max_blocks]`` int32, padded with 0.
        logits_indices: ``[N]`` position in ``[0, T)`` of each sampled row's last token.
        token_sources: ``[T]`` for steps with in-flight tokens (``PLACEHOLDER`` ids): the row of the previous
            step's sampled tokens that holds the token, -1 for ids known on the host; None when there are none.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    slot_mapping: torch.Tensor
    q_lens: torch.Tensor
    seq_lens_k: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    token_sources: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def plan_step(
    seqs: list[Sequence],
    num_tokens: list[int],
    sample: list[bool],
    tables: BlockTableBuffer,
    block_size: int,
    pad_decode_to: int | None = None,
) -> StepPlan:
    """Lay out the step: sequence ``i`` computes tokens ``[num_computed, num_computed + num_tokens[i])``.

    One pass over the sequences gathers their counters and new token ids into flat arrays; everything else is
    tensor ops. ``pad_decode_to``: for a decode-only step, append dummy one-token sequences (slot -1, context 1)
    up to this batch size so the step matches a captured graph's shape.
    """
    assert seqs, "plan_step needs at least one scheduled sequence"
    per_seq, ids = array("q"), array("q")
    for seq, n, smp in zip(seqs, num_tokens, sample):
        c = seq.num_computed_tokens
        # An in-flight token is always a sequence's last one, so a chunk reaching the end brings it.
        per_seq.extend((c, n, seq.row, smp, seq.pending_row if c + n == len(seq.token_ids) else -1))
        ids.extend(seq.token_ids[c : c + n])
    start, q, rows, sampled, pending = torch.frombuffer(per_seq, dtype=torch.int64).view(len(seqs), 5).unbind(1)
    seq_lens = start + q
    cu = torch.cumsum(q, 0)
    if len(ids) == len(seqs):  # decode-only: one token per sequence, at its context's end
        pos, token_rows = start, rows
    else:
        owner = torch.repeat_interleave(torch.arange(len(seqs)), q, output_size=len(ids))  # [T] sequence of token
        pos = torch.arange(len(ids)) - (cu - q - start)[owner]
        token_rows = rows[owner]
    slots = tables.table[token_rows, pos // block_size].long() * block_size + pos % block_size
    block_tables = tables.gather(rows, -(-int(seq_lens.max()) // block_size))
    sources = None
    has_pending = pending >= 0
    if bool(has_pending.any()):
        sources = torch.full((len(ids),), -1, dtype=torch.int64)
        sources[(cu - 1)[has_pending]] = pending[has_pending]
    plan = StepPlan(torch.frombuffer(ids, dtype=torch.int64), pos, slots, q, seq_lens, block_tables,
                    (cu - 1)[sampled.bool()], sources)
    if pad_decode_to is not None and pad_decode_to > len(seqs) and len(ids) == len(seqs):
        plan = _pad_decode(plan, pad_decode_to - len(seqs))
    return plan


def _pad_decode(plan: StepPlan, extra: int) -> StepPlan:
    ones = torch.ones(extra, dtype=torch.int64)
    return StepPlan(
        input_ids=torch.cat([plan.input_ids, torch.zeros(extra, dtype=torch.int64)]),
        position_ids=torch.cat([plan.position_ids, torch.zeros(extra, dtype=torch.int64)]),
        slot_mapping=torch.cat([plan.slot_mapping, torch.full((extra,), -1, dtype=torch.int64)]),
        q_lens=torch.cat([plan.q_lens, ones]),
        seq_lens_k=torch.cat([plan.seq_lens_k, ones]),
        block_tables=torch.cat([plan.block_tables, plan.block_tables.new_zeros(extra, plan.block_tables.shape[1])]),
        logits_indices=plan.logits_indices,
        token_sources=None if plan.token_sources is None else torch.cat(
            [plan.token_sources, torch.full((extra,), -1, dtype=torch.int64)]),
    )


class ModelRunner:
    """Runs planned steps of ``model`` on ``cache``; input buffers hold ``max_tokens`` tokens on the device.

    ``compiled``: the model's compiled layers, which then serve its calls (``Engine(compile_layers=...)``).
    """

    def __init__(self, model: torch.nn.Module, cache: PagedAttentionCache, max_tokens: int, device: torch.device,
                 max_seqs: int = 256, max_blocks_per_seq: int = 256, compiled: CompiledLayers | None = None):
        self.model = model
        self.compiled = compiled
        self.cache = cache
        self.device = device
        self._cache_kwarg = cache_keyword(model)
        # The tokens the last step sampled, at a fixed address: where a step's in-flight ids are read from.
        self.last_tokens = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        # Flat, so a step's [1, t] views are contiguous whatever t (as compiled layers expect: no new strides).
        self._input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._position_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # On a GPU the attention metadata lives at fixed addresses too, so a (padded) decode step can be
        # graph-captured; on the CPU a copy would only add cost.
        self._meta_buffers = None
        if torch.device(device).type == "cuda":
            self._meta_buffers = MetadataBuffers(device)
            self._meta_buffers.reserve(max(max_tokens, max_seqs), max_seqs, max_blocks_per_seq)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in pinned memory on a CUDA machine: a copy from pageable memory may wait for the device's queue,
        which would stall an asynchronous step behind the one before it."""
        return t.pin_memory() if self.device.type == "cuda" else t

    def metadata(self, plan: StepPlan) -> PagedMetadata:
        return build_metadata(
            q_lens=plan.q_lens, seq_lens_k=plan.seq_lens_k, block_tables=plan.block_tables,
            slot_mapping=plan.slot_mapping, token_index=None, grid=(1, plan.num_tokens),
            block_size=self.cache.block_size, kv_caches=self.cache.pool.kv_caches,
            dispatcher=self.cache.dispatcher, device=self.device, buffers=self._meta_buffers,
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; returns ``[N, vocab]`` logits of the sampled rows (on the model's output device)."""
        t = plan.num_tokens
        if t > self._input_ids.shape[0]:
            self._input_ids = self._input_ids.new_zeros(t)
            self._position_ids = self._position_ids.new_zeros(t)
        self._input_ids[:t].copy_(self._host(plan.input_ids), non_blocking=True)
        self._position_ids[:t].copy_(self._host(plan.position_ids), non_blocking=True)
        if plan.token_sources is not None:  # in-flight ids: read the previous step's tokens on the device
            src = self._host(plan.token_sources).to(self.device, non_blocking=True)
            ids = self._input_ids[:t]
            ids.copy_(torch.where(src >= 0, self.last_tokens.index_select(0, src.clamp(min=0)), ids))
        keep = self._host(plan.logits_indices).to(self.device, non_blocking=True)
        self.cache.begin_step(self.metadata(plan))
        with self.compiled.active() if self.compiled is not None else nullcontext():
            out = self.model(
                input_ids=self._input_ids[:t].view(1, t), position_ids=self._position_ids[:t].view(1, t),
                use_cache=True, logits_to_keep=keep, **{self._cache_kwarg: self.cache},
            )
        return out.logits[0]
