"""Block tables of the rows of a ``generate`` batch, with sharing and copy-on-write.

``generate`` sees a cache as a ``[batch, columns]`` grid: each forward appends ``q_len`` columns; in a left-padded
batch some columns of a row are padding. Here each row keeps only its real tokens: a block table (list of block
ids) and a token count. Rows may share blocks (beam search, ``num_return_sequences``); a shared block that must be
written is copied first, so sharing never changes what another row reads.

``reserve`` hands a batch blocks before it needs them, so a batch that reserved all it will need cannot run out
mid-way. ``arm`` gives every row, from that reserve, the blocks of its next decode steps; each armed step is then
counted by ``advance`` alone, and the per-row lists catch up (``_materialize``) only when something reads them.
"""

from __future__ import annotations

import torch

from hf_paged.cache._block_allocator import OutOfBlocksError
from hf_paged.cache._kv_pool import KVPool


class BlockReserve:
    """The reserve and armed decode steps of :class:`~hf_paged.generate._batch_tables.BatchTables` (a mixin: it reads
    and writes the tables' ``pool``, ``num_columns``, ``_tables``, ``_num_tokens``, ``_spare``, ``_ahead``,
    ``_pending``, ``_advances_left``, ``_table_tensor`` and ``_steps_since_edit``, and calls ``_mark_valid``)."""

    # ----- decode steps without per-row bookkeeping ------------------------------------------------------------
    def arm(self, max_blocks: int) -> list[list[int]] | None:
        """Give every row, from the reserve, the blocks of its next ``h`` tokens, ``h`` as large as the reserve and
        ``max_blocks`` blocks a row allow, so that the next ``h`` decode steps may :meth:`advance`.

        Only for a batch that has run two forwards since it was last rebuilt (a reorder every step, as beam search
        makes, never arms) and whose rows own their last blocks (no copy-on-write pending). Returns each row's
        blocks, written and ahead (what a device block table must hold for those steps), or None when not armed.
        """
        self._settle()
        bs, ref_count = self.pool.block_size, self.pool.allocator.ref_count
        if self._steps_since_edit < 2 or any(
                n % bs and ref_count(t[-1]) > 1 for t, n in zip(self._tables, self._num_tokens)):
            return None

        def blocks_needed(h: int) -> list[int]:
            return [max(0, -(-(n + h) // bs) - len(t)) for t, n in zip(self._tables, self._num_tokens)]

        low, high = 0, max_blocks * bs - max(self._num_tokens, default=0)
        while low < high:  # the largest h whose blocks the reserve holds
            mid = (low + high + 1) // 2
            low, high = (mid, high) if sum(blocks_needed(mid)) <= len(self._spare) else (low, mid - 1)
        if low == 0:
            return None
        self._ahead = [self._take(k) for k in blocks_needed(low)]
        self._advances_left = low
        return [t + a for t, a in zip(self._tables, self._ahead)]

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
        """Bring the lists up to the steps :meth:`advance` counted (their blocks move from ahead to the tables)."""
        if not self._pending:
            return
        k, self._pending = self._pending, 0
        bs = self.pool.block_size
        for table, ahead, n in zip(self._tables, self._ahead, self._num_tokens):
            grow = -(-(n + k) // bs) - len(table)
            table.extend(ahead[:grow])
            del ahead[:grow]
        self._num_tokens = [n + k for n in self._num_tokens]
        self._mark_valid(self.num_columns - k, k, None)
        self._table_tensor = None

    def _settle(self) -> None:
        """Catch up and disarm: blocks given ahead and not written go back to the reserve."""
        self._materialize()
        if self._advances_left or any(self._ahead):
            for ahead in self._ahead:
                self._spare.extend(ahead)
                ahead.clear()
            self._advances_left = 0

    # ----- the reserve -----------------------------------------------------------------------------------------
    def reserve(self, num_blocks: int, hint: str = "") -> None:
        """Hand this batch ``num_blocks`` more blocks now, which later growth and copy-on-write take before asking
        the allocator: a batch that reserved all it will need cannot run out mid-way. All or nothing."""
        self._settle()
        alloc = self.pool.allocator
        if num_blocks > alloc.num_free:
            raise OutOfBlocksError(num_blocks, alloc.num_free, alloc.num_blocks, hint=hint)
        self._spare.extend(alloc.allocate(num_blocks))

    @property
    def num_reserved(self) -> int:
        """Blocks reserved by :meth:`reserve` and not yet written."""
        return len(self._spare) + sum(len(a) for a in self._ahead)

    def _take(self, n: int) -> list[int]:
        taken, self._spare = self._spare[:n], self._spare[n:]
        return taken if len(taken) == n else taken + self.pool.allocator.allocate(n - len(taken))


class BatchTables(BlockReserve):
    """Per-row block tables over a :class:`KVPool`, plus the host copy of which columns hold real tokens (the
    padding history ``crop`` needs), so no step has to read the caller's mask back from the device for it."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._tables: list[list[int]] = []
        self._num_tokens: list[int] = []
        self.num_columns = 0
        self._valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, capacity]: which columns hold real tokens
        self._table_tensor: torch.Tensor | None = None  # block_table_tensor(), rebuilt only after tables change
        self._spare: list[int] = []  # blocks handed to this batch ahead of need (see reserve)
        self._ahead: list[list[int]] = []  # per row, the reserved blocks it will write next (see arm)
        self._pending = 0  # decode steps counted by advance, not yet in the lists
        self._advances_left = 0  # decode steps advance may still count (0: not armed)
        self._steps_since_edit = 0  # forwards since the rows were last rebuilt (a new batch, a reorder, a crop)

    @property
    def num_rows(self) -> int:
        return len(self._tables)

    @property
    def tables(self) -> list[list[int]]:
        """Each row's block ids, in order (the blocks it has written into)."""
        self._materialize()
        return self._tables

    @property
    def num_tokens(self) -> list[int]:
        """Each row's real tokens."""
        self._materialize()
        return self._num_tokens

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def reset(self) -> None:
        self._settle()
        for table in self._tables:
            self.pool.allocator.free(table)
        self.pool.allocator.free(self._spare)
        self._spare = []
        self._tables, self._num_tokens, self._ahead, self.num_columns = [], [], [], 0
        self._valid = torch.zeros(0, 0, dtype=torch.bool)
        self._table_tensor = None
        self._steps_since_edit = 0

    def start(self, num_rows: int) -> None:
        self.reset()
        self._tables = [[] for _ in range(num_rows)]
        self._num_tokens = [0] * num_rows
        self._ahead = [[] for _ in range(num_rows)]
        self._valid = torch.zeros(num_rows, 0, dtype=torch.bool)

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
                "before a new batch, or pass the whole input with its attention mask"
            )
        if attention_mask is None:
            return None
        if q_len == 1 and self.num_columns > 0:
            # A decode step (one column more than is held, checked above): generate appends a column of ones every
            # step, and beam reordering, repeats and crops edit this host copy of the padding along with the rows.
            # So the mask is read back (one copy) only on a batch's first forward and on multi-token forwards
            # (chunked prefill, assisted decoding's candidates, a caller's own extend).
            return None
        valid = attention_mask[:, -q_len:].to("cpu", torch.bool)
        return None if bool(valid.all()) else valid

    def append(self, q_len: int, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Add one forward's ``q_len`` columns. ``valid``: ``[rows, q_len]`` bool (host), True where the token is
        real; None = every token is real (a decode step of ``generate``).

        Reserves blocks for all rows at once (nothing changes if they do not fit), copies shared blocks that will
        be written, and returns the ``[T]`` int64 slot of each real token in row-major order.
        """
        self._settle()
        rows, bs = self.num_rows, self.pool.block_size
        n_new = [q_len] * rows if valid is None else valid.sum(1).tolist()
        alloc = self.pool.allocator
        cow = self._rows_to_copy(n_new)
        grow = [-(-(n + k) // bs) - len(t) for t, n, k in zip(self._tables, self._num_tokens, n_new)]
        needed = len(cow) + sum(grow)
        if needed > alloc.num_free + len(self._spare):
            hint = f"(this step adds {sum(n_new)} tokens to {rows} rows of {bs}-token blocks)"
            if alloc.num_used:
                hint += (f" The cache's sequences still hold {alloc.num_used} blocks: cache.reset() frees them (the "
                         "next generate call does so itself).")
            raise OutOfBlocksError(needed, alloc.num_free + len(self._spare), alloc.num_blocks, hint=hint)
        if cow:
            fresh = self._take(len(cow))
            self.pool.copy_blocks([self._tables[r][-1] for r in cow], fresh)
            for r, b in zip(cow, fresh):
                alloc.free([self._tables[r][-1]])
                self._tables[r][-1] = b
        grown = [r for r in range(rows) if grow[r]]
        for r in grown:
            self._tables[r].extend(self._take(grow[r]))
        if q_len == 1 and self._table_tensor is not None:  # a decode step changes at most each row's last block
            if cow or grown:
                self._table_tensor = self._with_last_blocks(cow + grown)
        else:
            self._table_tensor = None
        slots = self._slots(q_len, valid)
        self._num_tokens = [n + k for n, k in zip(self._num_tokens, n_new)]
        self._mark_valid(self.num_columns, q_len, valid)
        self.num_columns += q_len
        self._steps_since_edit += 1
        return slots

    def _slots(self, q_len: int, valid: torch.Tensor | None) -> torch.Tensor:
        """Slot of each new real token, before ``num_tokens`` counts them."""
        bs = self.pool.block_size
        if valid is None and q_len == 1:  # decode: one token per row, a few host integers
            return torch.tensor([t[n // bs] * bs + n % bs for t, n in zip(self._tables, self._num_tokens)],
                                dtype=torch.int64)
        rows = self.num_rows
        if valid is None:
            valid = torch.ones(rows, q_len, dtype=torch.bool)
        start = torch.tensor(self._num_tokens, dtype=torch.int64)
        pos = (start[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)  # [rows, q_len] position of each token
        row_idx = torch.arange(rows)[:, None].expand(rows, q_len)
        slots = self.block_table_tensor()[row_idx, pos // bs].long() * bs + pos % bs
        return slots[valid]

    def _rows_to_copy(self, n_new: list[int]) -> list[int]:
        """Rows that must copy their shared last (partial) block before writing into it.

        Of ``w`` writers sharing a block held ``c`` times, ``w`` copy if someone else still holds it, else ``w - 1``:
        the last writer keeps the original.
        """
        bs, ref_count = self.pool.block_size, self.pool.allocator.ref_count
        writers: dict[int, list[int]] = {}
        for r, (table, n, k) in enumerate(zip(self._tables, self._num_tokens, n_new)):
            if k and n % bs and ref_count(table[-1]) > 1:  # a block held once is its writer's alone
                writers.setdefault(table[-1], []).append(r)
        rows = []
        for block, ws in writers.items():
            rows += ws if len(ws) < ref_count(block) else ws[:-1]
        return rows

    def block_table_tensor(self) -> torch.Tensor:
        """``[rows, max_blocks]`` int32, padded with 0. Never changed in place: a plan may keep it."""
        self._materialize()
        if self._table_tensor is None:
            width = max(1, max((len(t) for t in self._tables), default=0))
            flat = [b for t in self._tables for b in (*t, *[0] * (width - len(t)))]
            self._table_tensor = torch.tensor(flat, dtype=torch.int32).view(self.num_rows, width)
        return self._table_tensor

    def _with_last_blocks(self, rows: list[int]) -> torch.Tensor:
        """The block-table tensor after the last block of each of ``rows`` changed (a new tensor: a plan may keep the
        old one), in one indexed write instead of a rebuild from the lists."""
        old = self._table_tensor
        width = max(old.shape[1], max(len(self._tables[r]) for r in rows))
        table = old.new_zeros(self.num_rows, width)
        table[:, : old.shape[1]] = old
        table[rows, [len(self._tables[r]) - 1 for r in rows]] = torch.tensor([self._tables[r][-1] for r in rows],
                                                                             dtype=torch.int32)
        return table

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
        new_tables = [list(self._tables[r]) for r in rows]
        for t in new_tables:
            self.pool.allocator.share(t)
        for t in self._tables:
            self.pool.allocator.free(t)
        self._tables = new_tables
        self._num_tokens = [self._num_tokens[r] for r in rows]
        self._ahead = [[] for _ in rows]
        self._valid = self._valid[torch.tensor(rows, dtype=torch.long)] if rows else self._valid[:0]
        self._table_tensor = None
        self._steps_since_edit = 0

    def crop(self, max_columns: int) -> None:
        """Keep the first ``max_columns`` columns of every row and free the blocks past them."""
        if max_columns >= self.num_columns:
            return
        self._settle()
        keep = self._valid[:, :max_columns].sum(1).tolist()
        for r, n in enumerate(keep):
            nb = self._blocks_for(n)
            self.pool.allocator.free(self._tables[r][nb:])
            del self._tables[r][nb:]
            self._num_tokens[r] = n
        self._valid[:, max_columns:] = False
        self.num_columns = max_columns
        self._table_tensor = None
        self._steps_since_edit = 0

    def stats(self) -> dict:
        self._materialize()
        bs = self.pool.block_size
        fill: dict[int, int] = {}
        for table, n in zip(self._tables, self._num_tokens):
            for i, b in enumerate(table):
                fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))
        alloc = self.pool.allocator
        slots = (alloc.num_used - self.num_reserved) * bs
        return {
            "num_blocks": alloc.num_blocks,
            "block_size": bs,
            "blocks_used": alloc.num_used,
            "blocks_free": alloc.num_free,
            "blocks_reserved": self.num_reserved,
            "tokens_stored": sum(self._num_tokens),
            "internal_fragmentation": 0.0 if slots == 0 else 1.0 - sum(fill.values()) / slots,
        }
