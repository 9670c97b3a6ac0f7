"""``BlockReserve``: blocks a ``generate`` batch holds ahead of need, and decode steps that write into them.

``reserve`` hands a batch blocks before it needs them, so a batch that reserved all it will need cannot run out
mid-way. ``arm`` gives every row, from that reserve, the blocks of its next decode steps; each armed step is then
counted by ``advance`` alone, and the per-row lists catch up (``_materialize``) only when something reads them.
"""

from __future__ import annotations

from hf_paged.cache._block_allocator import OutOfBlocksError


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
