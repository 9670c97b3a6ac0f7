"""The step plan: one flat int32 layout of everything a step's attention needs, from the scheduler's choice.

``plan_step`` is pure: it reads the scheduled sequences (or a decode step's kept :class:`DecodeColumns`) and the
block-table buffer, and returns a :class:`StepPlan` whose every array (ids, positions, slots, lengths, block
tables, sampled rows) lies in one int32 layout, built in numpy or in one pass of per-sequence Python (never per
token). ``ModelRunner`` (``runner/_model_runner.py``) sends that layout to the device in one copy.

On a GPU the rows whose logits a step computes are padded to a few sizes (``plan_step(pad_logits=True)``,
:func:`logit_rows`). cuBLAS picks a kernel for each new shape of a product on the host, and the ``lm_head``
product (``[rows, hidden] x [hidden, vocab]``) is the costly one to pick for: on an H200 a 1B model's first product
of a new row count took 13-27 ms of host time (2026-11-29, 128k vocabulary), enough to stall the steps behind it.
Unpadded, a workload's mixed steps bring a new row count almost every step; padded, a process meets at most a
dozen. On the CPU nothing is picked, and a padded row would cost its full share of the product: no padding.
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hf_paged.attention._metadata import PagedMetadata, Phase, step_phase
from hf_paged.cache._block_table import BlockTableBuffer


class Sequence(Protocol):
    """What a step plan reads of a scheduled sequence (the engine's ``Sequence`` is one)."""

    token_ids: list[int]
    block_table: list[int]
    row: int
    num_computed_tokens: int
    pending_row: int


#: The segments of a plan's layout, in order; each is ``T`` (tokens), ``S`` (sources: ``T`` or 0), ``N`` (sampled
#: rows), ``B`` (sequences), ``B + 1`` or ``B x W`` (block-table width) int32 values long.
_COMPUTED, _ROW, _PENDING_ROW = (operator.attrgetter(a) for a in ("num_computed_tokens", "row", "pending_row"))
_SEGMENTS = ("input_ids", "position_ids", "slot_mapping", "token_sources", "logits_indices", "q_lens", "seq_lens_k",
             "cu_seqlens_q", "cu_seqlens_k", "block_tables")


def logit_rows(n: int) -> int:
    """The rows a padded step computes logits for when it returns ``n``: the next power of two up to 256 (at most
    twice ``n``), then the next multiple of 256 (at most 255 more). On a GPU, ``lm_head`` at these row counts reads
    its weights once whatever the rows, so the padding costs little beside a new shape's kernel choice (module
    docstring)."""
    if n <= 256:
        return 0 if n <= 0 else 1 << (n - 1).bit_length()
    return -(-n // 256) * 256


@dataclass(frozen=True)
class StepPlan:
    """One step (``T`` tokens of ``B`` sequences, ``N`` sampled rows) as one flat int32 host tensor, ``layout``::

        [ ids (T) | positions (T) | slots (T) | sources (T or 0) | logits indices (L) | q lens (B) |
          context lengths (B) | cu q (B + 1) | cu k (B + 1) | block tables (B x W) ]

    so that a step's inputs reach the device in one copy (``ModelRunner``); the segments are read as views, of the
    host layout (as attributes: ``plan.input_ids``) or of its device copy (:meth:`segments`).

    Segments:
        input_ids, position_ids: ``[T]``.
        slot_mapping: ``[T]`` physical slot ``block * block_size + offset``; -1 = padding token (no write).
        token_sources: ``[T]`` for steps with in-flight tokens (``PLACEHOLDER`` ids): the row of the previous
            step's sampled tokens that holds the token, -1 for ids known on the host; None when there are none.
        logits_indices: ``[L]`` position in ``[0, T)`` of each sampled row's last token, then ``L - N`` repeats of
            the last one (``padded_rows``: their logits are computed and dropped).
        q_lens, seq_lens_k: ``[B]`` new tokens / context length after the step; cu_seqlens_q/k: ``[B + 1]``.
        block_tables: ``[B, W]``, padded with 0.
    Plain fields: the sizes, and what the attention metadata needs on the host (``max_seqlen_q/k``, ``phase``,
    whether padding rows with slot -1 are present, ``single_token_prefix``: the leading sequences that bring one
    token each in a step that is not all decode).
    """

    layout: torch.Tensor
    num_seqs: int
    num_tokens: int
    num_sampled: int
    width: int
    has_sources: bool
    max_seqlen_q: int
    max_seqlen_k: int
    phase: Phase
    has_padding: bool = False
    single_token_prefix: int = 0
    padded_rows: int = 0

    def segments(self, layout: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """The named segments as views of ``layout`` (default: the host one; or its copy on a device)."""
        t, b = self.num_tokens, self.num_seqs
        rows = self.num_sampled + self.padded_rows  # L: the rows the model's lm_head computes
        sizes = (t, t, t, t if self.has_sources else 0, rows, b, b, b + 1, b + 1, b * self.width)
        views = dict(zip(_SEGMENTS, (self.layout if layout is None else layout)[: sum(sizes)].split(sizes)))
        views["block_tables"] = views["block_tables"].view(b, self.width)
        if not self.has_sources:
            views["token_sources"] = None
        return views

    def __getattr__(self, name: str) -> torch.Tensor | None:
        if name in _SEGMENTS:
            return self.segments()[name]
        raise AttributeError(name)


def step_metadata(plan: StepPlan, seg: dict[str, torch.Tensor], slots: torch.Tensor, block_size: int) -> PagedMetadata:
    """The attention metadata of every engine step: ``plan``'s host fields and its segments on the device (``seg``,
    with ``slots`` as int64), whether the host laid them out (an eager step) or a decode graph computed them."""
    return PagedMetadata(
        num_seqs=plan.num_seqs, num_tokens=plan.num_tokens, max_seqlen_q=plan.max_seqlen_q,
        max_seqlen_k=plan.max_seqlen_k, block_size=block_size, phase=plan.phase, cu_seqlens_q=seg["cu_seqlens_q"],
        cu_seqlens_k=seg["cu_seqlens_k"], seq_lens_k=seg["seq_lens_k"], block_tables=seg["block_tables"],
        slot_mapping=slots, token_index=None, grid=(1, plan.num_tokens), has_padding_slots=plan.has_padding,
        single_token_prefix=plan.single_token_prefix)


@dataclass(frozen=True)
class DecodeColumns:
    """The per-sequence columns of a decode step (one token per sequence), int32 arrays of ``B``.

    ``ids``: each token's id where the host knows it; ``positions``: its position (the sequence's computed count);
    ``sources``: the row of the in-flight step's sampled tokens that holds it (-1: the id is known); ``rows``: the
    sequence's block-table row.
    """

    ids: np.ndarray
    positions: np.ndarray
    sources: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, seqs: list[Sequence], sample: list[bool] | None = None) -> DecodeColumns:
        """Columns of ``seqs``, each computing its token at ``num_computed_tokens``. A row that does not sample
        (``sample[i]`` False) computes a token before its last one, which the host knows."""
        n = len(seqs)
        pos = np.fromiter(map(_COMPUTED, seqs), np.int32, n)
        ids = np.fromiter([s.token_ids[c] for s, c in zip(seqs, pos.tolist())], np.int32, n)
        src = np.fromiter(map(_PENDING_ROW, seqs), np.int32, n)
        if sample is not None and not all(sample):
            src[~np.fromiter(sample, bool, n)] = -1
        return cls(ids, pos, src, np.fromiter(map(_ROW, seqs), np.int32, n))


def plan_step(seqs: list[Sequence], num_tokens: list[int], sample: list[bool], tables: BlockTableBuffer,
              block_size: int, extra_rows: list[int] | None = None, pad_logits: bool = False) -> StepPlan:
    """Lay out the step: sequence ``i`` computes tokens ``[num_computed, num_computed + num_tokens[i])``.

    A decode step (one token per sequence) is laid out in numpy from its :class:`DecodeColumns`. Any other step
    gathers the sequences' counters and new token ids into flat arrays (per-sequence Python; a prefill chunk's
    positions and slots are ranges, extended in C, one per block it touches). The block tables are taken with one
    ``np.take``. (A decode graph pads its steps itself, on the device: ``runner/_decode_graphs.py``.)
    ``extra_rows``: positions in ``[0, T)`` whose logits the step returns too, after the
    sampled rows' (prompt logprobs). ``pad_logits``: pad the logits rows to :func:`logit_rows` (on a GPU).
    """
    assert seqs, "plan_step needs at least one scheduled sequence"
    if sum(num_tokens) == len(seqs) and not extra_rows:
        return _plan_decode(DecodeColumns.of(seqs, sample), sample, tables, block_size, pad_logits)
    ids, pos, slots, keep, q, ctx, rows = (array("i") for _ in range(7))
    pending: list[tuple[int, int]] = []  # (token index, source row) of in-flight tokens
    t = 0
    for seq, n, smp in zip(seqs, num_tokens, sample):
        c = seq.num_computed_tokens
        end = c + n
        ids.extend(seq.token_ids[c:end])
        pos.extend(range(c, end))
        _extend_slots(slots, seq.block_table, c, end, block_size)
        t += n
        if smp:  # the chunk reaches the end, so it brings the in-flight token (always a sequence's last one)
            keep.append(t - 1)
            if seq.pending_row >= 0:
                pending.append((t - 1, seq.pending_row))
        q.append(n)
        ctx.append(end)
        rows.append(seq.row)
    if extra_rows:
        keep.extend(extra_rows)
    sampled = len(keep)
    if pad_logits and keep:
        keep.extend(keep[-1:] * (logit_rows(sampled) - sampled))
    num_seqs = len(seqs)
    sources = array("i", (-1,)) * (t if pending else 0)  # a segment only where ids are in flight
    for i, row in pending:
        sources[i] = row
    max_k = max(ctx)
    width = -(-max_k // block_size)
    head = ids + pos + slots + sources + keep + q + ctx
    cu = len(head)  # then cu q, cu k (B + 1 each), block tables
    # Built in numpy (a small numpy op costs a fraction of a torch op on the host); the plan holds a torch view.
    layout = np.empty(cu + 2 * (num_seqs + 1) + num_seqs * width, dtype=np.int32)
    layout[:cu] = np.frombuffer(head, dtype=np.int32)
    _lengths_and_tables(layout, cu, num_seqs, width, tables, np.frombuffer(rows, dtype=np.int32))
    ones = np.frombuffer(q, dtype=np.int32) == 1  # the decode rows in front of a mixed step's prefill chunks
    return StepPlan(torch.from_numpy(layout), num_seqs, t, sampled, width, bool(pending), max(q), max_k,
                    step_phase(num_seqs, sum(ctx) > t, t == num_seqs), padded_rows=len(keep) - sampled,
                    single_token_prefix=len(ones) if ones.all() else int(ones.argmin()))


def _lengths_and_tables(layout: np.ndarray, cu: int, b: int, width: int, tables: BlockTableBuffer,
                        rows: np.ndarray) -> None:
    """Write the rest of the layout from offset ``cu``: cu q and cu k (``B + 1`` each), the prefix sums of the ``B``
    q lengths and the ``B`` context lengths that end at ``cu``; then the block tables of the ``B`` ``rows``."""
    layout[cu] = layout[cu + b + 1] = 0
    np.cumsum(layout[cu - 2 * b : cu - b], dtype=np.int32, out=layout[cu + 1 : cu + b + 1])
    np.cumsum(layout[cu - b : cu], dtype=np.int32, out=layout[cu + b + 2 : cu + 2 * b + 2])
    np.take(tables.entries[:, :width], rows, axis=0, out=layout[cu + 2 * b + 2 :].reshape(b, width))


def _plan_decode(cols: DecodeColumns, sample: list[bool], tables: BlockTableBuffer, bs: int,
                 pad_logits: bool) -> StepPlan:
    """The layout of a decode step, one numpy write per segment: slots from the block-table rows, in-flight ids as
    sources."""
    pos, b = cols.positions, len(cols.positions)
    max_k = int(pos.max()) + 1
    width = -(-max_k // bs)
    has_sources = bool((cols.sources >= 0).any())
    all_sampled = all(sample)
    k = b if all_sampled else sum(sample)
    rows = logit_rows(k) if pad_logits else k
    cu = (4 if has_sources else 3) * b + rows + 2 * b  # then cu q, cu k (B + 1 each), block tables
    layout = np.empty(cu + 2 * (b + 1) + b * width, dtype=np.int32)
    layout[:b], layout[b : 2 * b] = cols.ids, pos
    np.add(tables.entries[cols.rows, pos // bs] * bs, pos % bs, out=layout[2 * b : 3 * b])  # slots
    at = 3 * b
    if has_sources:
        layout[at : at + b] = cols.sources
        at += b
    layout[at : at + k] = np.arange(b) if all_sampled else np.flatnonzero(sample)
    layout[at + k : at + rows] = layout[at + k - 1] if k else 0
    at += rows
    layout[at : at + b] = 1  # q lengths
    np.add(pos, 1, out=layout[at + b : cu])  # context lengths
    _lengths_and_tables(layout, cu, b, width, tables, cols.rows)
    return StepPlan(torch.from_numpy(layout), b, b, k, width, has_sources, 1, max_k, step_phase(b, max_k > 1, True),
                    padded_rows=rows - k)


def _extend_slots(slots: array, table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the slots of positions ``[start, end)``: one range per block they touch."""
    while start < end:
        block, offset = divmod(start, block_size)
        stop = min(end, start - offset + block_size)
        base = table[block] * block_size - (start - offset)
        slots.extend(range(base + start, base + stop))
        start = stop
