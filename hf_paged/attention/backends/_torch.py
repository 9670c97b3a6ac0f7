"""Pure PyTorch paged attention: runs on any device and dtype, and is the oracle for every other backend.

A step is computed in pieces, one after the other. A piece is a run of consecutive sequences (a step's decode rows,
or many short prompts) or a run of query rows of one long sequence. It reads its context through the block tables,
padded to its own longest context ``K`` (and its queries to its own longest ``Q``), and computes masked attention
with the softmax in float32. Padding stays inside a piece, so the workspace does not grow with batch x longest query
x longest context: a piece of ``n`` sequences takes at most (:func:`piece_bytes`)::

    n*Q*K*(2*H*c + 2) + 3*n*Q*H*D*c + n*Hkv*D*K'*(2*c + s)  bytes

for the scores and their softmax, the mask, the queries and the output, and K or V (one at a time) as gathered,
dequantized and laid out for the products (``H``, ``Hkv``, ``D``: query heads, KV heads, head_dim; ``c``: bytes of
the compute dtype, 4; ``s``: of the cache; ``K'``: ``K`` rounded up to whole blocks). Pieces are cut to take at most
:data:`WORKSPACE_BYTES` of the device's kind (64 MiB on a CPU) where one query row alone does not take more, so one
layer's attention takes at most (:func:`workspace_bytes`)::

    max(WORKSPACE_BYTES, piece_bytes(n=1, Q=1, K=the step's longest context))  bytes

beyond its ``[T, H, D]`` output, whatever the step's sequences. The cut is made once per step (:class:`StepPlan`,
which reads the step's lengths to the host: one device sync per step on a GPU) and per layer shape.

Clear rather than fast: GPU serving paths use flash or cuda. It is also what serves an fp8 KV cache for now,
dequantizing what it gathers (``kv_scales``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from hf_paged.attention.backends.base import (AttentionBackend, AttentionCall, AttentionInputs, AttentionParams,
                                              register_backend)
from hf_paged.cache._kv_quant import KVScales, dequantize
from hf_paged.attention._metadata import PagedMetadata

#: The most bytes one piece of a step may take (:func:`piece_bytes`), by the kind of device; the CPU's for others.
WORKSPACE_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}


def piece_bytes(n: int, q: int, k: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                compute_size: int = 4, cache_size: int = 4) -> int:
    """The most bytes a piece of ``n`` sequences padded to ``q`` query rows and ``k`` context tokens takes (the
    module's formula); ``compute_size``/``cache_size``: bytes of an element of the compute dtype / of the cache."""
    gathered = -(-k // block_size) * block_size
    return (n * q * k * (2 * num_heads * compute_size + 2) + 3 * n * q * num_heads * head_dim * compute_size
            + n * num_kv_heads * head_dim * gathered * (2 * compute_size + cache_size))


def workspace_bytes(device_type: str, longest_context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, compute_size: int = 4, cache_size: int = 4) -> int:
    """The most bytes one layer's attention of a step whose longest context is ``longest_context`` takes on a device
    of ``device_type`` (the module's bound)."""
    budget = WORKSPACE_BYTES.get(device_type, WORKSPACE_BYTES["cpu"])
    return max(budget, piece_bytes(1, 1, longest_context, num_heads, num_kv_heads, head_dim, block_size,
                                   compute_size, cache_size))


@dataclass(frozen=True)
class Piece:
    """Sequences ``seqs`` of a step attending in one go: query rows ``tokens`` of the packed query (the rows
    ``first_row`` on of each, all of them unless the piece is part of one sequence), padded to ``[n, q]`` rows over
    the first ``k`` context tokens; ``rows``: where each packed row sits in the padded ``[n * q]`` (None when no row
    is padding)."""

    seqs: slice
    tokens: slice
    first_row: int
    q: int
    k: int
    rows: torch.Tensor | None


@dataclass
class StepPlan:
    """A step's sequence lengths on the host, read once per step for every layer, and its pieces per layer shape."""

    q_lens: list[int]
    k_lens: list[int]
    pieces: dict[tuple, list[Piece]] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: PagedMetadata) -> StepPlan:
        """The plan of ``meta``; a fixed-shape decode step (``meta.static``, whose lengths change in place between
        steps) is planned from its bound ``max_seqlen_k``, without reading the device."""
        if meta.static:
            return cls([1] * meta.num_seqs, [meta.max_seqlen_k] * meta.num_seqs)
        cu_q = meta.cu_seqlens_q
        return cls(*torch.stack((cu_q[1:] - cu_q[:-1], meta.seq_lens_k)).tolist())  # one copy to the host

    def cut(self, budget: int, shape: tuple, device: torch.device) -> list[Piece]:
        """The pieces of this step for a layer of ``shape`` (:func:`piece_bytes`'s arguments after the lengths),
        each within ``budget`` bytes unless it is a single query row: consecutive sequences while they fit together,
        and a sequence too large alone in runs of query rows."""
        key = (budget, shape, device)
        if key in self.pieces:
            return self.pieces[key]
        pieces, start, width, depth = [], 0, 0, 0
        starts = [0, *accumulate(self.q_lens)]  # each sequence's first packed row
        for b, (q, k) in enumerate(zip(self.q_lens, self.k_lens)):
            if b > start and piece_bytes(b + 1 - start, max(width, q), max(depth, k), *shape) > budget:
                pieces.append(self._group(start, b, width, depth, starts, device))
                start, width, depth = b, 0, 0
            width, depth = max(width, q), max(depth, k)
            if b == start and piece_bytes(1, q, k, *shape) > budget:  # alone too large: runs of its rows
                per_row = piece_bytes(1, 1, k, *shape) - piece_bytes(1, 0, k, *shape)
                run = max(1, (budget - piece_bytes(1, 0, k, *shape)) // per_row)
                for first in range(0, q, run):
                    last = min(q, first + run)
                    pieces.append(Piece(slice(b, b + 1), slice(starts[b] + first, starts[b] + last), first,
                                        last - first, k - q + last, None))
                start, width, depth = b + 1, 0, 0
        if start < len(self.q_lens):
            pieces.append(self._group(start, len(self.q_lens), width, depth, starts, device))
        self.pieces[key] = [p for p in pieces if p.tokens.stop > p.tokens.start]
        return self.pieces[key]

    def _group(self, start: int, stop: int, width: int, depth: int, starts: list[int],
               device: torch.device) -> Piece:
        """The piece of whole sequences ``start:stop``, padded to ``width`` rows and ``depth`` context tokens."""
        q_lens = self.q_lens[start:stop]
        rows = None
        if any(q != width for q in q_lens):  # row r of the piece's i-th sequence sits at i * width + r
            rows = torch.tensor([i * width + r for i, q in enumerate(q_lens) for r in range(q)], device=device)
        return Piece(slice(start, stop), slice(starts[start], starts[stop]), 0, width, depth, rows)


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                              params: AttentionParams, compute_dtype: torch.dtype = torch.float32,
                              kv_scales: KVScales | None = None, plan: StepPlan | None = None) -> torch.Tensor:
    """Attention of packed ``query`` [T, H, D] over the paged context; returns [T, H, D] in ``query.dtype``.

    Query ``t`` of sequence ``b`` sits at absolute position ``i = seq_lens_k[b] - q_len[b] + t`` and sees keys
    ``j <= i`` (and ``i - j < sliding_window`` when set). Pass ``compute_dtype=torch.float64`` for a reference.
    An fp8 cache needs its ``kv_scales``: the gathered context is dequantized to ``compute_dtype``. ``plan``: the
    step's :class:`StepPlan`, made here when not given.
    """
    (num_heads, head_dim), num_kv_heads = query.shape[1:], k_cache.shape[2]
    shape = (num_heads, num_kv_heads, head_dim, k_cache.shape[1], compute_dtype.itemsize, k_cache.element_size())
    budget = WORKSPACE_BYTES.get(query.device.type, WORKSPACE_BYTES["cpu"])
    out = torch.empty_like(query)
    for piece in (plan or StepPlan.of(meta)).cut(budget, shape, query.device):
        out[piece.tokens] = _attend_piece(query, k_cache, v_cache, meta, params, compute_dtype, kv_scales, piece)
    return out


def _attend_piece(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                  params: AttentionParams, compute_dtype: torch.dtype, kv_scales: KVScales | None,
                  piece: Piece) -> torch.Tensor:
    """One piece's attention: its packed rows of ``query`` attended over their contexts, [rows, H, D]."""
    (num_heads, head_dim), num_kv_heads = query.shape[1:], k_cache.shape[2]
    groups, seqs, rows = num_heads // num_kv_heads, piece.seqs, piece.rows
    n, q_len, k_len = seqs.stop - seqs.start, piece.q, piece.k
    q = query[piece.tokens]
    if rows is not None:  # packed -> padded
        q = q.new_zeros(n * q_len, num_heads, head_dim).index_copy_(0, rows, q)
    q = _dense(q.view(n, q_len, num_kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4), compute_dtype)
    k = _context(k_cache, meta.block_tables[seqs], k_len, compute_dtype, None if kv_scales is None else kv_scales.k)
    scores = torch.matmul(q.view(n, num_kv_heads, groups * q_len, head_dim), k.transpose(-1, -2))
    del q, k
    scores = scores.view(n, num_kv_heads, groups, q_len, k_len).mul_(params.scale)
    if params.softcap is not None:
        scores.div_(params.softcap).tanh_().mul_(params.softcap)

    # Each row's absolute position: the sequence's context minus its new tokens, plus the row's place among them.
    cu_q = meta.cu_seqlens_q
    starts = meta.seq_lens_k[seqs].long() - (cu_q[seqs.start + 1:seqs.stop + 1] - cu_q[seqs]).long()
    q_pos = (starts + piece.first_row)[:, None, None] + torch.arange(q_len, device=query.device)[:, None]
    k_pos = torch.arange(k_len, device=query.device)
    hidden = k_pos > q_pos  # [n, Q, K]: keys after the row (padding rows are dropped below)
    if params.sliding_window is not None:
        hidden |= k_pos <= q_pos - params.sliding_window
    scores = torch.softmax(scores.masked_fill_(hidden[:, None, None], float("-inf")), dim=-1)
    del hidden
    v = _context(v_cache, meta.block_tables[seqs], k_len, compute_dtype, None if kv_scales is None else kv_scales.v)
    out = torch.matmul(scores.view(n, num_kv_heads, groups * q_len, k_len), v)
    out = out.view(n, num_kv_heads, groups, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(n * q_len, num_heads,
                                                                                           head_dim)
    return out if rows is None else out.index_select(0, rows)


def _context(cache: torch.Tensor, block_tables: torch.Tensor, length: int, dtype: torch.dtype,
             scale: torch.Tensor | None) -> torch.Tensor:
    """The first ``length`` tokens of each sequence of ``block_tables`` [n, nb] read from ``cache`` [num_blocks, bs,
    Hkv, D], as [n, Hkv, length, D] in ``dtype`` (an fp8 cache's dequantized with its ``scale`` [Hkv])."""
    blocks = cache[block_tables[:, :max(1, -(-length // cache.shape[1]))].long()]  # [n, nb, bs, Hkv, D]
    context = blocks.flatten(1, 2)[:, :length]
    if scale is not None:
        context = dequantize(context, scale, dtype)
    return _dense(context.permute(0, 2, 1, 3), dtype)


def _dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` copied into a new contiguous tensor of ``dtype`` (one copy for the layout and the dtype)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


@register_backend
class TorchBackend(AttentionBackend):
    """Serves every phase on every device; sliding window and softcap included."""

    name = "torch"
    priority = 100

    def unsupported_reason(self, call: AttentionCall) -> str | None:
        return None

    def write_unsupported_reason(self, device_type, dtype, head_dim) -> str | None:
        return None

    def plan(self, meta: PagedMetadata) -> StepPlan:
        return StepPlan.of(meta)

    def forward(self, inputs: AttentionInputs, plan: StepPlan | None) -> torch.Tensor:
        return paged_attention_reference(inputs.query, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.params,
                                         kv_scales=inputs.kv_scales, plan=plan)
