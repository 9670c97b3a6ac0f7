"""``DeviceBlockTable``: the engine's block tables on the device, kept current by sending only the entries that changed.

A decode step served by a CUDA graph reads its rows' tables from this copy: the host sends the rows' indices (``b``
values), not their tables (``b x width`` values: 8 MB a step for 256 sequences of a model with 128k positions at
block 16), plus the few entries written since the step before (about one per 16 sequences in steady decode).
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.cache._block_table import BlockTableBuffer
from hf_paged.runner._staging import StagingBuffer


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
        self.pad_row = rows = host.table.shape[0]
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
        if not (n := len(flat)):
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

    def sync(self) -> None:
        """Queue the entries written on the host since the last call."""
        self.send(*self.changes())

    def close(self) -> None:
        """Stop the host's change log (this copy is no longer read)."""
        self.host.log_changes(False)
