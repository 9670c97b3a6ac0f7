"""Per-step attention metadata: built once per forward pass, read by every layer.

A step schedules ``num_seqs`` sequences; sequence ``i`` brings ``q_len[i] >= 0`` new tokens and, after this step,
holds ``seq_lens_k[i]`` tokens in the cache (its cached prefix plus the new ones). The new tokens of all sequences
are packed into one ``[num_tokens, ...]`` axis in sequence order.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch


class Phase(str, enum.Enum):
    """What kind of attention a step needs, which decides the kernel that serves it.

    - ``PREFILL``: every sequence attends only to its own new tokens (no cached prefix): the new K/V suffice.
    - ``EXTEND``: some sequence has a cached prefix and some sequence brings more than one new token
      (chunked prefill, prefix-cache hits, prefill mixed with decode): K/V are read through the block tables.
    - ``DECODE``: every sequence brings exactly one new token.
    """

    PREFILL = "prefill"
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(frozen=True)
class PagedMetadata:
    """Flat tensors describing one step, never changed once built (what backends decide once per step lives in the
    step: ``PagedStep.plan``). Integer tensors are int32 unless noted.

    Attributes:
        num_seqs: sequences in the step (``B``).
        num_tokens: new tokens over all sequences (``T``).
        max_seqlen_q / max_seqlen_k: longest new-token run / longest context after the step.
        block_size: tokens per KV block.
        phase: see :class:`Phase`.
        cu_seqlens_q: ``[B + 1]`` prefix sums of new-token counts.
        cu_seqlens_k: ``[B + 1]`` prefix sums of ``seq_lens_k``.
        seq_lens_k: ``[B]`` context length of each sequence after this step's tokens are written.
        block_tables: ``[B, max_blocks]`` physical block ids, padded with 0 (read only below ``seq_lens_k``).
        slot_mapping: ``[T]`` int64 physical slot (``block * block_size + offset``) of each new token; -1 = padding.
        token_index: ``[T]`` int64 flat index into the caller's ``[batch, q_len]`` token grid of each packed token,
            or None when the grid is already packed (every position is a real token, in order).
        grid: ``(batch, q_len)`` shape of the caller's token grid.
        has_padding_slots: whether ``slot_mapping`` contains -1 entries (kept on the host to avoid a sync).
        static: a decode step of fixed shapes at fixed addresses (``hf_paged/generate/_static_decode.py``), which a
            compiled forward traces, with the KV write and the attention as custom ops, rather than break around.
        scratch_per_call: backends allocate their scratch (decode split partials) for each call instead of reusing
            a buffer kept between calls. The custom ops of a compiled forward set it: memory first allocated inside
            a CUDA-graph-captured step may not outlive the step (CUDA graph trees refuse it on the next capture).
        single_token_prefix: how many sequences at the front of a prefill / extend step bring one new token each
            (the decode rows of a step that mixes decode with prefill chunks: the engine's scheduler puts running
            sequences first). A backend may serve them with its decode kernel and the rest with its prefill kernel;
            0 (the default) when unknown.
    """

    num_seqs: int
    num_tokens: int
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    phase: Phase
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens_k: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    token_index: torch.Tensor | None
    grid: tuple[int, int]
    has_padding_slots: bool
    static: bool = False
    scratch_per_call: bool = False
    single_token_prefix: int = 0

    _TENSOR_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "seq_lens_k", "block_tables", "slot_mapping", "token_index")

    def on(self, device: torch.device | str) -> PagedMetadata:
        """This metadata with its tensors on ``device`` (itself when they are there); a step copies it once per
        device (``PagedStep.on``), for layers split over devices under ``device_map``."""
        if self.slot_mapping.device == torch.device(device):
            return self
        return dataclasses.replace(self, **{
            name: None if getattr(self, name) is None else getattr(self, name).to(device, non_blocking=True)
            for name in self._TENSOR_FIELDS})


def step_phase(num_seqs: int, has_prefix: bool, one_token_each: bool) -> Phase:
    """The :class:`Phase` of a step: ``has_prefix``, some sequence has a cached prefix (context longer than its
    new tokens); ``one_token_each``, every sequence brings exactly one new token."""
    if num_seqs and one_token_each and has_prefix:
        return Phase.DECODE
    return Phase.EXTEND if has_prefix else Phase.PREFILL


def build_metadata(*, q_lens: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                   slot_mapping: torch.Tensor, token_index: torch.Tensor | None, grid: tuple[int, int], block_size: int,
                   device: torch.device) -> PagedMetadata:
    """Assemble a :class:`PagedMetadata` from host tensors and move it to ``device`` in one go.

    Args:
        q_lens: ``[B]`` new tokens per sequence (host, int).
        seq_lens_k: ``[B]`` context length after the step (host, int).
        block_tables: ``[B, max_blocks]`` (host, int).
        slot_mapping: ``[T]`` (host, int).
        token_index: ``[T]`` or None (host, int).
    """
    q_lens, seq_lens_k = q_lens.to(torch.int32), seq_lens_k.to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    num_seqs, pin = int(q_lens.numel()), device.type == "cuda"

    def as_dev(t: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return t.to(dtype).pin_memory().to(device, non_blocking=True) if pin else t.to(device, dtype)

    return PagedMetadata(
        num_seqs=num_seqs, num_tokens=int(slot_mapping.numel()), max_seqlen_q=int(q_lens.max()) if num_seqs else 0,
        max_seqlen_k=int(seq_lens_k.max()) if num_seqs else 0, block_size=block_size,
        phase=step_phase(num_seqs, bool((seq_lens_k > q_lens).any()), bool((q_lens == 1).all())),
        cu_seqlens_q=as_dev(torch.cat([zero, torch.cumsum(q_lens, 0, dtype=torch.int32)])),
        cu_seqlens_k=as_dev(torch.cat([zero, torch.cumsum(seq_lens_k, 0, dtype=torch.int32)])),
        seq_lens_k=as_dev(seq_lens_k), block_tables=as_dev(block_tables),
        slot_mapping=as_dev(slot_mapping, torch.int64),
        token_index=None if token_index is None else as_dev(token_index, torch.int64), grid=grid,
        has_padding_slots=bool((slot_mapping < 0).any()))
