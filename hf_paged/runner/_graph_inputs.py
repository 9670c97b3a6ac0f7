"""The decode graphs' staged inputs (``DecodeGraphs``): one int32 row of seven ``b``-long segments per step of ``b``
rows, laid out in pinned memory and copied to the device in one go, at an address the captured graphs read.

Segments: token ids, positions, sources (the row of ``last_tokens`` whose token a row takes, -1 for the id given),
block-table rows, then the step's block-table updates (flat int64 indices over two segments, their int32 values in
the seventh). Padding rows are token 0 at position 0 in the all-zero table row (``pad_row``; the graph gives them slot
-1), and unused updates write 0 to the scratch entry (``trash_index``).
"""

from __future__ import annotations

import numpy as np
import torch

SEGMENTS = 7


def fill_step(host: np.ndarray, b: int, ids, positions, sources, rows, pad_row: int, flat: np.ndarray,
              values: np.ndarray, trash_index: int) -> None:
    """Write a step of ``len(rows)`` real rows padded to ``b``, and ``len(flat)`` (at most ``b``) table updates, into
    ``host`` (``SEGMENTS * b`` int32)."""
    n, k = len(rows), len(flat)
    host[:n] = ids
    host[b : b + n] = positions
    host[2 * b : 2 * b + n] = sources
    host[3 * b : 3 * b + n] = rows
    if n < b:
        for start, value in ((0, 0), (b, 0), (2 * b, -1), (3 * b, pad_row)):
            host[start + n : start + b] = value
    updates = host[4 * b : 6 * b].view(np.int64)
    updates[:k] = flat
    updates[k:] = trash_index
    host[6 * b : 6 * b + k] = values
    host[6 * b + k : 7 * b] = 0


def fill_padding(stage: torch.Tensor, b: int, pad_row: int, trash_index: int) -> None:
    """A step of ``b`` padding rows on the device (nothing written, nothing real read): what warm-up and capture run
    on."""
    stage[: 2 * b].zero_()
    stage[2 * b : 3 * b].fill_(-1)
    stage[3 * b : 4 * b].fill_(pad_row)
    stage[4 * b : 6 * b].view(torch.int64).fill_(trash_index)
    stage[6 * b : 7 * b].zero_()


def read(stage: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
    """(ids, positions, sources, rows, update indices as int64, update values): views of a staged step of ``b``."""
    return (stage[:b], stage[b : 2 * b], stage[2 * b : 3 * b], stage[3 * b : 4 * b],
            stage[4 * b : 6 * b].view(torch.int64), stage[6 * b : 7 * b])
