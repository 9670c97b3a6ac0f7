"""``BlockTableBuffer``: the block tables of all live sequences in one fixed-capacity host tensor.

Each sequence holding blocks owns a row; the block manager writes only the entries that change (appended or
copied-on-write blocks), so a step's ``block_tables`` is one ``index_select`` of the scheduled rows, not a rebuild
from Python lists. Unused entries hold 0, which the kernels never read (they stop at ``seq_lens_k``).

A device copy (``hf_paged.runner``'s ``DeviceBlockTable``) follows the writes through the change log
(:meth:`BlockTableBuffer.log_changes`).
"""

from __future__ import annotations

from array import array

import numpy as np
import torch


class BlockTableBuffer:
    """``table``: ``[max_rows, width]`` int32; grows in width when a sequence needs more blocks than it has columns."""

    def __init__(self, max_rows: int, width: int):
        self.table = torch.zeros(max_rows, max(width, 1), dtype=torch.int32)
        # ``table`` as a numpy array, the same memory (numpy writes a few entries ~10x faster than torch); replaced
        # when the table grows, so read it each step
        self.entries = self.table.numpy()
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._changes: tuple[array, array] | None = None  # (rows, columns) of the entries written, when logged

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int:
        assert self._free_rows, "more live sequences than block-table rows"
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        """Free ``row``. Its entries are zeroed here; a device copy keeps them (no kernel reads past a sequence's
        length, and a row's next owner writes every entry it reads)."""
        self.entries[row] = 0
        self._free_rows.append(row)

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Set entries ``[start, start + len(blocks))`` of ``row`` (and log them, when logging)."""
        end = start + len(blocks)
        if end > self.table.shape[1]:  # grow the table, at least doubling it
            grown = torch.zeros(self.table.shape[0], max(end, 2 * self.table.shape[1]), dtype=torch.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table, self.entries = grown, grown.numpy()
        self.entries[row, start:end] = blocks
        if self._changes is not None:
            self._changes[0].extend((row,) * len(blocks))
            self._changes[1].extend(range(start, end))

    def log_changes(self, on: bool = True) -> None:
        """Start (or stop) recording writes for :meth:`take_changes` (a device copy's updates)."""
        if not on:
            self._changes = None
        elif self._changes is None:
            self._changes = (array("i"), array("i"))

    @property
    def num_changes(self) -> int:
        """Writes logged since the last :meth:`take_changes` (0 when not logging)."""
        return len(self._changes[0]) if self._changes is not None else 0

    def take_changes(self) -> tuple[array, array]:
        """The ``(rows, columns)`` of the entries written since the last call (an entry may repeat)."""
        changes = self._changes
        assert changes is not None, "take_changes() needs log_changes() first"
        self._changes = (array("i"), array("i"))
        return changes
