"""Block tables of the rows of a ``generate`` batch, kept by a :class:`~hf_paged.cache._block_manager.BlockManager`.

``generate`` sees a cache as a ``[batch, columns]`` grid: each forward appends ``q_len`` columns; in a left-padded
batch some columns of a row are padding. Here each row keeps only its real tokens, as one sequence of a block
manager (without prefix caching), which gives it its blocks, shares them between rows (beam search,
``num_return_sequences``) and copies a shared block before it is written, so sharing never changes what another row
reads. What is kept here is the grid: which columns of each row hold real tokens, and the row edits ``generate``
makes (new batches, reorders, crops).

A batch may take blocks ahead of its tokens (``append(..., ahead=n)``): one that took all it will need cannot run
out mid-way. ``arm`` checks that every row holds the blocks of its next decode steps; each armed step is then
counted by ``advance`` alone, and the rows' counts catch up (``_materialize``) only when something reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_paged.cache._block_allocator import OutOfBlocksError
from hf_paged.cache._block_manager import BlockManager
from hf_paged.cache._block_table import BlockTableBuffer
from hf_paged.cache._kv_pool import KVPool
from hf_paged.hf._transient import real_tokens


@dataclass(eq=False)
class _Row:
    """One row of the batch as a block-manager sequence (no token ids: nothing is prefix-cached)."""

    block_table: list[int] = field(default_factory=list)
    row: int = -1
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    last_block_hash: bytes | None = None


class BatchTables:
    """The rows of a ``generate`` batch over a :class:`KVPool`, plus the host copy of which columns hold real tokens
    (the padding history ``crop`` needs), so no step has to read the caller's mask back from the device for it."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.manager = BlockManager(pool.allocator, pool.block_size, BlockTableBuffer(0, 1), pool.copy_blocks,
                                    enable_prefix_caching=False)
        self._rows: list[_Row] = []
        self._pending = 0  # decode steps counted by advance, not yet in the rows
        self._advances_left = 0  # decode steps advance may still count (0: not armed)
        self.start(0)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def tables(self) -> list[list[int]]:
        """Each row's block ids, in order (those it has written into, then any it holds ahead)."""
        self._materialize()
        return [r.block_table for r in self._rows]

    @property
    def num_tokens(self) -> list[int]:
        """Each row's real tokens."""
        self._materialize()
        return [r.num_computed_tokens for r in self._rows]

    def _new_rows(self, num_rows: int) -> list[_Row]:
        """``num_rows`` empty rows on a new block-table buffer (row ``i`` of the buffer is row ``i`` of the batch)."""
        self.manager.tables = BlockTableBuffer(num_rows, 1)
        self.manager.tables.log_changes()
        self._table_tensor: torch.Tensor | None = None  # block_table_tensor(), rebuilt only after tables change
        self._steps_since_edit = 0  # forwards since the rows were last rebuilt (a new batch, a reorder, a crop)
        return [_Row() for _ in range(num_rows)]

    def start(self, num_rows: int) -> None:
        """Free every row's blocks and start a batch of ``num_rows`` empty rows (none: an empty batch)."""
        self._settle()
        for r in self._rows:
            self.manager.free(r)
        self._rows, self.num_columns = self._new_rows(num_rows), 0
        for r in self._rows:
            r.row = self.manager.tables.acquire()
        self._valid = torch.zeros(num_rows, 0, dtype=torch.bool)  # [rows, capacity]: which columns hold real tokens

    def begin_forward(self, attention_mask: torch.Tensor | None, batch_size: int, q_len: int) -> torch.Tensor | None:
        """Start a new batch, or check that this forward continues the held one; returns the host ``[batch, q_len]``
        bool of the forward's real tokens, or None when all are real.

        ``attention_mask`` is ``[batch, kept + q_len]`` (None: the held columns plus ``q_len`` real ones): the caller
        says the cache holds the input's first ``kept`` columns. ``kept == 0`` (the whole input, say a second
        ``model(...)`` call on a used cache) starts afresh; a ``kept`` other than what is held raises.
        """
        held = self.num_columns
        kept = held if attention_mask is None else attention_mask.shape[-1] - q_len
        if self.num_rows == 0 or held == 0 or kept == 0:
            self.start(batch_size)
        elif kept != held or batch_size != self.num_rows:
            raise ValueError(
                f"this PagedAttentionCache holds {self.num_rows} sequences of {held} columns, but the input "
                f"continues {kept} columns of {batch_size} sequences; call cache.reset() (or make a new cache) "
                "before a new batch, or pass the whole input with its attention mask")
        # A decode step (one column more than is held, checked above) reads no mask: generate appends a column of
        # ones every step, and beam reordering, repeats and crops edit this host copy of the padding along with the
        # rows. So the mask is read back (one copy) only on a batch's first forward and on multi-token forwards
        # (chunked prefill, assisted decoding's candidates, a caller's own extend).
        decode = q_len == 1 and self.num_columns > 0
        return None if attention_mask is None or decode else real_tokens(attention_mask, q_len)

    def append(self, q_len: int, valid: torch.Tensor | None = None, ahead: int = 0, hint: str = "") -> torch.Tensor:
        """Add one forward's ``q_len`` columns. ``valid``: ``[rows, q_len]`` bool (host), True where the token is
        real; None = every token is real (a decode step of ``generate``).

        Gives every row the blocks of its new tokens and of ``ahead`` tokens more, all rows at once (nothing changes
        if they do not fit: ``OutOfBlocksError``, with ``hint``), copies shared blocks that will be written, and
        returns the ``[T]`` int64 slot of each real token in row-major order.
        """
        self._settle()
        n_new = [q_len] * self.num_rows if valid is None else valid.sum(1).tolist()
        wanted = [k + ahead for k in n_new]
        manager, alloc = self.manager, self.pool.allocator
        needed = manager.blocks_to_reserve(self._rows, wanted)
        if needed > manager.num_free_blocks:
            if not hint:
                hint = (f"(this step adds {sum(n_new)} tokens to {self.num_rows} rows of {self.pool.block_size}-token "
                        "blocks)")
                if alloc.num_used:
                    hint += (f" The cache's sequences still hold {alloc.num_used} blocks: cache.reset() frees them "
                             "(the next generate call does so itself).")
            raise OutOfBlocksError(needed, manager.num_free_blocks, alloc.num_blocks, hint=hint)
        for r, n in zip(self._rows, wanted):
            if n:
                manager.reserve_up_to(r, n)  # (all of n: checked above; most decode steps take its fast path)
        slots = self._slots(q_len, valid)
        manager.commit(self._rows, n_new)
        self._mark_valid(self.num_columns, q_len, valid)
        self.num_columns += q_len
        self._steps_since_edit += 1
        return slots

    def _slots(self, q_len: int, valid: torch.Tensor | None) -> torch.Tensor:
        """Slot of each new real token, before the rows count them."""
        bs = self.pool.block_size
        if valid is None and q_len == 1:  # decode: one token per row, a few host integers
            return torch.tensor([r.block_table[r.num_computed_tokens // bs] * bs + r.num_computed_tokens % bs
                                 for r in self._rows], dtype=torch.int64)
        rows = self.num_rows
        if valid is None:
            valid = torch.ones(rows, q_len, dtype=torch.bool)
        start = torch.tensor([r.num_computed_tokens for r in self._rows], dtype=torch.int64)
        pos = (start[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)  # [rows, q_len] position of each token
        row_idx = torch.arange(rows)[:, None].expand(rows, q_len)
        slots = self.block_table_tensor()[row_idx, pos // bs].long() * bs + pos % bs
        return slots[valid]

    def block_table_tensor(self) -> torch.Tensor:
        """``[rows, max_blocks]`` int32, padded with 0. Never changed in place: a plan may keep it."""
        self._materialize()
        buffer = self.manager.tables
        width = max(1, max((len(r.block_table) for r in self._rows), default=0))
        if self._table_tensor is None or buffer.num_changes or self._table_tensor.shape[1] != width:
            buffer.take_changes()
            self._table_tensor = buffer.table[: self.num_rows, :width].clone()
        return self._table_tensor

    def _mark_valid(self, start: int, q_len: int, valid: torch.Tensor | None) -> None:
        """Record which of columns ``[start, start + q_len)`` hold real tokens (``valid``; None = all)."""
        need = start + q_len
        if need > self._valid.shape[1]:
            grown = torch.zeros(self.num_rows, max(need, 2 * self._valid.shape[1]), dtype=torch.bool)
            grown[:, :start] = self._valid[:, :start]
            self._valid = grown
        self._valid[:, start:need] = True if valid is None else valid

    def select_rows(self, rows: list[int]) -> None:
        """Rebuild the batch from ``rows`` (indices into the current rows, repeats allowed), sharing blocks."""
        self._settle()
        old = self._rows
        for r in old:
            r.row = -1  # its row of the block-table buffer goes with the buffer
        self._rows = self._new_rows(len(rows))
        for i, child in zip(rows, self._rows):
            self.manager.fork(old[i], child, old[i].num_computed_tokens)
        for r in old:
            self.manager.free(r)
        self._valid = self._valid[torch.tensor(rows, dtype=torch.long)] if rows else self._valid[:0]

    def crop(self, max_columns: int) -> None:
        """Keep the first ``max_columns`` columns of every row and free the blocks past them."""
        if max_columns >= self.num_columns:
            return
        self._settle()
        for r, n in zip(self._rows, self._valid[:, :max_columns].sum(1).tolist()):
            self.manager.truncate(r, n)
        self._valid[:, max_columns:] = False
        self.num_columns = max_columns
        self._steps_since_edit = 0

    # ----- decode steps without per-row bookkeeping ------------------------------------------------------------
    def arm(self, max_blocks: int) -> bool:
        """Let the next ``h`` decode steps :meth:`advance`, ``h`` as large as the blocks every row holds and
        ``max_blocks`` blocks a row allow; returns whether ``h > 0``.

        Only for a batch that has run two forwards since it was last rebuilt (a reorder every step, as beam search
        makes, never arms) and whose rows own the blocks they write next (no copy-on-write pending). Those steps
        write into the blocks :meth:`block_table_tensor` holds now (written and ahead).
        """
        self._settle()
        rows, bs = self._rows, self.pool.block_size
        if self._steps_since_edit < 2 or any(self.manager.blocks_needed(r, 0) for r in rows):
            return False
        room = min((len(r.block_table) * bs - r.num_computed_tokens for r in rows), default=0)
        self._advances_left = max(0, min(room, max_blocks * bs - max((r.num_computed_tokens for r in rows), default=0)))
        return self._advances_left > 0

    def advance(self) -> bool:
        """Append one real token to every row (a decode step) by counting it, when armed; False otherwise (then
        :meth:`append` it)."""
        if not self._advances_left:
            return False
        self._advances_left -= 1
        self._pending += 1
        self.num_columns += 1
        return True

    def _materialize(self) -> None:
        """Bring the rows' counts up to the steps :meth:`advance` counted."""
        if self._pending:
            k, self._pending = self._pending, 0
            self.manager.commit(self._rows, [k] * self.num_rows)
            self._mark_valid(self.num_columns - k, k, None)

    def _settle(self) -> None:
        """Catch up and disarm."""
        self._materialize()
        self._advances_left = 0

    def stats(self) -> dict:
        self._materialize()
        bs = self.pool.block_size
        fill: dict[int, int] = {}
        for r in self._rows:
            for i, b in enumerate(r.block_table):
                fill[b] = max(fill.get(b, 0), min(bs, r.num_computed_tokens - i * bs))
        alloc = self.pool.allocator
        reserved = sum(len(r.block_table) - -(-r.num_computed_tokens // bs) for r in self._rows)  # blocks ahead
        slots = (alloc.num_used - reserved) * bs
        return {
            "num_blocks": alloc.num_blocks,
            "block_size": bs,
            "blocks_used": alloc.num_used,
            "blocks_free": alloc.num_free,
            "blocks_reserved": reserved,
            "tokens_stored": sum(r.num_computed_tokens for r in self._rows),
            "internal_fragmentation": 0.0 if slots == 0 else 1.0 - sum(fill.values()) / slots,
        }
