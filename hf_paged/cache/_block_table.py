"""``BlockTableBuffer``: the block tables of all live sequences in one fixed-capacity host tensor, and
``DeviceBlockTable``: its copy on the device, kept current by sending only the entries that changed.

Each sequence holding blocks owns a row; the block manager writes only the entries that change (appended or
copied-on-write blocks), so a step's ``block_tables`` is one ``index_select`` of the scheduled rows, not a rebuild
from Python lists. Unused entries hold 0, which the kernels never read (they stop at ``seq_lens_k``).

A decode step served by a CUDA graph reads its rows' tables from the device copy: the host sends the rows' indices
(``b`` values), not their tables (``b x width`` values: 8 MB a step for 256 sequences of a model with 128k positions
at block 16), plus the few entries written since the step before (about one per 16 sequences in steady decode).
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from hf_paged.runner._staging import StagingBuffer


class BlockTableBuffer:
    """``table``: ``[max_rows, width]`` int32; grows in width when a sequence needs more blocks than it has columns."""

    def __init__(self, max_rows: int, width: int):
        self.table = torch.zeros(max_rows, max(width, 1), dtype=torch.int32)
        self._entries = self.table.numpy()  # the same memory: numpy writes a few entries ~10x faster than torch
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._changes: tuple[array, array] | None = None  # (rows, columns) of the entries written, when logged

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
        """Free ``row``. Its entries are zeroed here; a device copy keeps them (no kernel reads past a sequence's
        length, and a row's next owner writes every entry it reads)."""
        self._entries[row] = 0
        self._free_rows.append(row)

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Set entries ``[start, start + len(blocks))`` of ``row``."""
        end = start + len(blocks)
        self._fit(end)
        self._entries[row, start:end] = blocks
        if self._changes is not None:
            rows, columns = self._changes
            rows.extend((row,) * len(blocks))
            columns.extend(range(start, end))

    def write_entries(self, rows: list[int], columns: list[int], blocks: list[int]) -> None:
        """Set entry ``(rows[i], columns[i])`` to ``blocks[i]`` for every ``i``: one numpy write for many rows."""
        self._fit(max(columns, default=-1) + 1)
        self._entries[rows, columns] = blocks
        if self._changes is not None:
            logged_rows, logged_columns = self._changes
            logged_rows.extend(rows)
            logged_columns.extend(columns)

    def _fit(self, width: int) -> None:
        """Grow the table (at least doubling it) to ``width`` columns if it has fewer."""
        if width > self.table.shape[1]:
            grown = torch.zeros(self.table.shape[0], max(width, 2 * self.table.shape[1]), dtype=torch.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table, self._entries = grown, grown.numpy()

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


class DeviceBlockTable:
    """A copy of ``host``'s first ``width`` columns on ``device``: ``[max_rows + 2, width]`` int32. Its row
    ``pad_row`` stays 0, for a captured step's padding rows; the row after it is scratch, where a captured step's
    unused update entries land (``trash_index``, a flat index).

    The host's writes reach it in order with the device's work: :meth:`changes` hands them out as flat indices and
    values (a CUDA graph applies them inside the step that reads them), :meth:`sync` queues them on the current
    stream (one copy, one ``index_copy_``). Columns at or past ``width`` are not kept: a step of a sequence that long
    does not read this copy.
    """

    def __init__(self, host: BlockTableBuffer, width: int, device: torch.device):
        self.host, self.width, self.device = host, width, torch.device(device)
        rows = host.table.shape[0]
        self.pad_row = rows
        self.trash_index = (rows + 1) * width
        self.table = torch.zeros(rows + 2, width, dtype=torch.int32, device=self.device)
        host.log_changes()
        host.take_changes()  # what the host holds now is copied whole
        current = host.table[:, :width]
        self.table[:rows, : current.shape[1]].copy_(current)
        self._staging = StagingBuffer(1024, self.device) if self.device.type == "cuda" else None

    def changes(self) -> tuple[np.ndarray, np.ndarray]:
        """The entries written on the host since the last call: int64 flat indices into ``table`` and their int32
        current values (an entry written twice comes twice, with its last value both times)."""
        rows, columns = self.host.take_changes()
        r, c = np.frombuffer(rows, dtype=np.int32), np.frombuffer(columns, dtype=np.int32)
        if len(c) and c.max() >= self.width:
            keep = c < self.width
            r, c = r[keep], c[keep]
        return r.astype(np.int64) * self.width + c, self.host.entries[r, c]

    def send(self, flat: np.ndarray, values: np.ndarray) -> None:
        """Queue the writing of ``values`` at ``flat`` (from :meth:`changes`) on the current stream."""
        n = len(flat)
        if not n:
            return
        if self._staging is None:
            index, source = torch.from_numpy(flat), torch.from_numpy(values)
        else:
            host = self._staging.host_array(3 * n)  # int64 flat indices as int32 pairs (little-endian), then values
            host[: 2 * n].view(np.int64)[:] = flat
            host[2 * n :] = values
            sent = self._staging.send(3 * n)
            index, source = sent[: 2 * n].view(torch.int64), sent[2 * n :]
        self.table.view(-1).index_copy_(0, index, source)

    def sync(self) -> int:
        """Queue the entries written on the host since the last call; returns how many were sent."""
        flat, values = self.changes()
        self.send(flat, values)
        return len(flat)

    def close(self) -> None:
        """Stop the host's change log (this copy is no longer read)."""
        self.host.log_changes(False)
