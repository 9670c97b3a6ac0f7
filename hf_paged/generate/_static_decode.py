"""Decode steps of fixed shape at fixed addresses, so that ``generate`` may compile them.

A compiled decode step (``torch.compile`` with CUDA graphs, as ``generate`` does for a cache whose
``is_compileable`` is True) replays the same kernels on the same tensors every step: it may read new *values* but
not new shapes, new addresses or host integers that change. So for a batch of ``B`` rows whose longest row may reach
``W`` blocks (its prompt plus ``max_new_tokens``), every decode step's metadata is the *same* :class:`PagedMetadata`
object whose tensors are updated in place before the forward:

::

    cu_seqlens_q [B + 1]   0, 1, ..., B                        fixed
    seq_lens_k   [B]       tokens of each row after the step    rewritten each step
    cu_seqlens_k [B + 1]   their prefix sums                    rewritten each step
    slot_mapping [B]       slot of each row's new token         rewritten each step
    block_tables [B, W]    each row's blocks, padded with 0      rewritten when a row's table changes
    max_seqlen_k = W * block_size                               fixed bound: kernels read each row's real length

The host work (appending tokens, taking blocks, copy-on-write after a beam reorder) stays eager: ``generate``
plans each step through the mask function before it calls the compiled forward. A batch's first forward takes the
blocks of its prompts plus ``max_new_tokens`` (``StaticDecode.append``). Once it has decoded a step without
being rebuilt, its rows are *armed* (``BatchTables.arm``): the slot of every position that their uploaded table
(the blocks they wrote and those they hold ahead) covers is found once, on the device (``[B, W * block_size]``), and
each later step is :meth:`StaticDecode.advance`: in place on the device (lengths, their sums, the position index,
a gather of the slots; one launch of ``hf_paged::advance_decode`` where the CUDA kernels are loaded, else four torch
ops), no host list walked, no host-to-device copy, no new tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from hf_paged import _compat
from hf_paged.attention._dispatch import Dispatcher, decode_calls
from hf_paged.attention._metadata import PagedMetadata, Phase, build_metadata
from hf_paged.cache._config import positive_int
from hf_paged.cache._kv_pool import KVPool
from hf_paged.cache._kv_quant import is_fp8
from hf_paged.generate._batch_tables import BatchTables
from hf_paged.kernels import _build as build

logger = logging.getLogger("hf_paged")


class StaticDecode:
    """A cache's decode steps of fixed shape: whether they are on (``is_compileable``) and why not, the blocks a batch
    takes ahead (with ``max_new_tokens``), and their one metadata object, rebuilt only when the batch size or the
    table width changes (the cache's ``compile_mode``)."""

    def __init__(self, config, pool: KVPool, dispatcher: Dispatcher, dtype: torch.dtype, max_new_tokens: int | None,
                 compileable: bool | None):
        if max_new_tokens is not None:
            positive_int("max_new_tokens", max_new_tokens, "or None")
        if compileable not in (None, True, False):
            raise ValueError(f"compileable must be True, False or None (automatic), got {compileable!r}")
        self.config, self.pool, self.dispatcher, self.dtype = config, pool, dispatcher, dtype
        self.max_new_tokens, self.compileable = max_new_tokens, compileable
        self.devices = [k.device for k, _ in pool.kv_caches]
        self.device = self.devices[0]
        self._reason: str | None | object = self._find_reason() if compileable else _UNDECIDED
        if compileable and self._reason is not None:
            raise ValueError(f"compileable=True, but {self._reason}")
        self.meta: PagedMetadata | None = None
        self._uploaded_table: torch.Tensor | None = None  # the host table whose values block_tables holds
        self._slot_column: torch.Tensor | None = None  # meta.slot_mapping as [B, 1]
        self._slot_of: torch.Tensor | None = None  # [B, W * block_size] int64: armed rows' slot of each position
        self._position: torch.Tensor | None = None  # [B, 1] int64: position of each row's latest token
        self._one_launch: bool | None = None  # whether advance is one kernel launch (asked once)

    @property
    def reason(self) -> str | None:
        """Why decode steps are not compileable (None when they are), found and logged once."""
        if self._reason is _UNDECIDED:  # (not a cached_property: compiled code reads it, and dynamo cannot lock)
            self._reason = self._find_reason()
            if self._reason is not None and not torch.compiler.is_compiling():
                _note_not_compileable(self._reason, self.max_new_tokens is not None)
        return self._reason

    @property
    def enabled(self) -> bool:
        return self.reason is None

    @property
    def width(self) -> int:
        return 0 if self.meta is None else self.meta.block_tables.shape[1]

    def size_for(self, num_rows: int, width: int) -> None:
        """Make room for ``num_rows`` rows of up to ``width`` blocks (new tensors only if the shape changes)."""
        if self.meta is not None and self.meta.num_seqs == num_rows and self.width >= width:
            return
        # lengths, slots and tables zero until plan writes them; max_seqlen_k the fixed bound of width blocks
        bs = self.pool.block_size
        meta = build_metadata(q_lens=torch.ones(num_rows, dtype=torch.int32),
                              seq_lens_k=torch.zeros(num_rows, dtype=torch.int32),
                              block_tables=torch.zeros(num_rows, width, dtype=torch.int32),
                              slot_mapping=torch.zeros(num_rows, dtype=torch.int64), token_index=None,
                              grid=(num_rows, 1), block_size=bs, device=self.device)
        self.meta = dataclasses.replace(meta, max_seqlen_q=1, max_seqlen_k=width * bs, phase=Phase.DECODE, static=True)
        self._uploaded_table = None
        # Compiled steps read (and, the pool, write) these at fixed addresses instead of copying them in: CUDA graphs
        # replay on them, and skip a step whose mutated inputs are not marked so.
        pool = self.pool
        fixed = [getattr(self.meta, name) for name in PagedMetadata._TENSOR_FIELDS] + [
            t for pair in pool.kv_caches for t in pair] + [t for s in pool.kv_scales or () for t in (s.k, s.v)]
        for t in fixed:
            if t is not None:
                _compat.mark_static_address(t)

    def plan(self, rows: BatchTables, slots: torch.Tensor) -> PagedMetadata:
        """The step's metadata after ``rows.append`` gave each row its one new token (``slots``: ``[B]`` host)."""
        table = rows.block_table_tensor()
        if table.shape[1] > self.width and self.meta is not None and self.meta.num_seqs == rows.num_rows:
            logger.warning(
                "hf_paged: a row outgrew the decode block table sized from max_new_tokens (%d > %d blocks): the "
                "table is widened, which recompiles a compiled decode step. Give the cache the max_new_tokens that "
                "generate is given.", table.shape[1], self.width)
        self.size_for(rows.num_rows, table.shape[1])
        meta = self.meta
        seq_lens = torch.tensor(rows.num_tokens, dtype=torch.int32)
        _upload(meta.seq_lens_k, seq_lens)
        _upload(meta.cu_seqlens_k[1:], torch.cumsum(seq_lens, 0, dtype=torch.int32))
        _upload(meta.slot_mapping, slots)
        if table is not self._uploaded_table:  # a table tensor is never changed in place (BatchTables)
            _upload(meta.block_tables[:, : table.shape[1]], table)
            self._uploaded_table = table
        if rows.arm(self.width):
            # the slot of every position the armed rows' uploaded table covers (columns past a row's own blocks hold
            # what an earlier table left there: an armed step never reaches them)
            bs = self.pool.block_size
            offsets = torch.arange(bs, device=self.device).repeat(self.width)
            self._slot_of = meta.block_tables.long().repeat_interleave(bs, 1) * bs + offsets
            self._position = (meta.seq_lens_k.long() - 1)[:, None]  # from the device copy: no synchronizing upload
            self._slot_column = meta.slot_mapping.view(-1, 1)
            if self._one_launch is None:
                # only where a backend loaded the kernels already: this saves microseconds, not worth a build
                self._one_launch = self.device.type == "cuda" and build.is_loaded()
        return meta

    def advance(self) -> PagedMetadata:
        """The next decode step's metadata after ``BatchTables.advance`` counted it: one more token per row, its
        slot read from the armed table, all in place on the device."""
        meta = self.meta
        if self._one_launch:  # the host time before a compiled step's graph launch is what the GPU waits for
            torch.ops.hf_paged.advance_decode(meta.seq_lens_k, meta.cu_seqlens_k, self._position, self._slot_of,
                                              meta.slot_mapping)
            return meta
        meta.seq_lens_k.add_(1)
        meta.cu_seqlens_k.add_(meta.cu_seqlens_q)  # row i's prefix sum grows by i
        self._position.add_(1)
        torch.gather(self._slot_of, 1, self._position, out=self._slot_column)
        return meta

    def append(self, rows: BatchTables, q_len: int, valid: torch.Tensor | None) -> torch.Tensor:
        """A forward's ``rows.append``. On a batch's first forward with ``max_new_tokens`` given, every row takes the
        blocks of its tokens and ``max_new_tokens`` more, so that a decode step never finds the pool empty (an
        ``OutOfBlocksError`` before the forward writes anything otherwise), and the decode metadata is sized."""
        if rows.num_columns or self.max_new_tokens is None:
            return rows.append(q_len, valid)
        slots = rows.append(q_len, valid, self.max_new_tokens, hint=(
            f"({rows.num_rows} rows: their prompts plus max_new_tokens={self.max_new_tokens} tokens each, in "
            f"{self.pool.block_size}-token blocks, are taken before decoding starts.)"))
        if self.enabled:
            self.size_for(rows.num_rows, max((len(t) for t in rows.tables), default=1))
        return slots

    def _find_reason(self) -> str | None:
        if self.compileable is False:
            return "the cache was made with compileable=False"
        if self.max_new_tokens is None:
            return ("the cache was not given max_new_tokens (the generate call's): decode blocks and the width of "
                    "the decode block table are fixed from it before decoding starts")
        if len(set(self.devices)) > 1:
            return "the KV cache is split over several devices"
        if self.compileable:  # asked for: compiled wherever the caller compiles
            return None
        device_type = self.device.type
        if device_type != "cuda":
            return (f"the KV cache is on {device_type}: transformers compiles generate's decode step on CUDA "
                    "(give the cache compileable=True to compile elsewhere, with a compile_config)")
        calls = decode_calls(self.config, self.pool.layout, device_type, self.dtype, self.pool.block_size,
                             self.pool.dtype if is_fp8(self.pool.dtype) else None)
        return self.dispatcher.capture_unsupported_reason(calls, self.dtype)


def _upload(dst: torch.Tensor, host: torch.Tensor) -> None:
    pin = dst.device.type == "cuda"
    dst.copy_(host.pin_memory() if pin else host, non_blocking=pin)


_UNDECIDED = object()


@functools.lru_cache(maxsize=None)
def _note_not_compileable(reason: str, asked: bool) -> None:
    log = logger.warning if asked else logger.info
    log("hf_paged: PagedAttentionCache.is_compileable is False, so generate runs decode steps eagerly: %s", reason)
