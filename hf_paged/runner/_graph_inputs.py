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


def read(stage, b: int, int64=torch.int64) -> tuple:
    """(ids, positions, sources, rows, update indices as int64, update values): views of a staged step of ``b`` in
    ``stage`` (a device tensor, or a host numpy array with ``int64=np.int64``)."""
    return (stage[:b], stage[b : 2 * b], stage[2 * b : 3 * b], stage[3 * b : 4 * b], stage[4 * b : 6 * b].view(int64),
            stage[6 * b : 7 * b])


def _padding(pad_row: int, trash_index: int) -> tuple[int, ...]:
    """What each segment holds past the real rows and updates: token 0 at position 0 with no source, in the all-zero
    table row; updates write 0 at the scratch entry."""
    return 0, 0, -1, pad_row, trash_index, 0


def fill_step(host: np.ndarray, b: int, ids, positions, sources, rows, pad_row: int, flat: np.ndarray,
              values: np.ndarray, trash_index: int) -> None:
    """Write a step of ``len(rows)`` real rows padded to ``b``, and ``len(flat)`` (at most ``b``) table updates, into
    ``host`` (``SEGMENTS * b`` int32)."""
    columns = (ids, positions, sources, rows, flat, values)
    for segment, column, pad in zip(read(host, b, np.int64), columns, _padding(pad_row, trash_index)):
        segment[: len(column)] = column
        segment[len(column) :] = pad


def fill_padding(stage: torch.Tensor, b: int, pad_row: int, trash_index: int) -> None:
    """A step of ``b`` padding rows on the device (nothing written, nothing real read): what warm-up and capture run
    on."""
    for segment, pad in zip(read(stage, b), _padding(pad_row, trash_index)):
        segment.fill_(pad)
