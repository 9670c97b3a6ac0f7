"""``BlockTableBuffer``: the block tables of all live sequences in one fixed-capacity host tensor.

Each sequence holding blocks owns a row; the block manager writes only the entries that change (appended or
copied-on-write blocks), so a step's ``block_tables`` is one ``index_select`` of the scheduled rows, not a rebuild
from Python lists. Unused entries hold 0, which the kernels never read (they stop at ``seq_lens_k``).
"""

from __future__ import annotations

import torch


class BlockTableBuffer:
    """``table``: ``[max_rows, width]`` int32; grows in width when a sequence needs more blocks than it has columns."""

    def __init__(self, max_rows: int, width: int):
        self.table = torch.zeros(max_rows, max(width, 1), dtype=torch.int32)
        self._entries = self.table.numpy()  # the same memory: numpy writes a few entries ~10x faster than torch
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def entries(self):
        """``table`` as a numpy array (the same memory; replaced when the table grows, so read it each step)."""
        return self._entries

    def acquire(self) -> int:
        assert self._free_rows, "more live sequences than block-table rows"
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self._entries[row] = 0
        self._free_rows.append(row)

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Set entries ``[start, start + len(blocks))`` of ``row``."""
        end = start + len(blocks)
        if end > self.table.shape[1]:
            grown = torch.zeros(self.table.shape[0], max(end, 2 * self.table.shape[1]), dtype=torch.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table, self._entries = grown, grown.numpy()
        self._entries[row, start:end] = blocks

    def gather(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The tables of ``rows`` (int32 or int64 indices) into ``out``: ``[len(rows), width]`` int32."""
        return torch.index_select(self.table[:, : out.shape[1]], 0, rows, out=out)
