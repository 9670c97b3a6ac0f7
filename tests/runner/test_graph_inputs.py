"""The decode graphs' staged row (hf_paged/runner/_decode_graphs.py): what the host writes is what the graph reads
back, padding rows read nothing real, and unused table updates land in the scratch entry."""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.runner import _decode_graphs as decode_graphs


def test_a_padded_step_reads_back_row_by_row():
    b, pad_row, trash = 6, 9, 1234
    host = np.full(decode_graphs.SEGMENTS * b, 77, dtype=np.int32)  # stale values from an earlier step
    flat, values = np.array([5, 40], dtype=np.int64), np.array([3, 8], dtype=np.int32)
    decode_graphs.fill_step(host, b, [11, 12, 13], [0, 4, 9], [-1, 2, -1], [0, 3, 1], pad_row, flat, values, trash)
    ids, pos, src, rows, at, vals = (t.tolist() for t in decode_graphs.read_stage(torch.from_numpy(host), b))
    assert ids == [11, 12, 13, 0, 0, 0] and pos == [0, 4, 9, 0, 0, 0]
    assert src == [-1, 2, -1, -1, -1, -1] and rows == [0, 3, 1, pad_row, pad_row, pad_row]
    assert at == [5, 40, trash, trash, trash, trash] and vals == [3, 8, 0, 0, 0, 0]


def test_a_full_step_has_no_padding_and_a_padding_step_has_nothing_else():
    b = 4
    host = np.zeros(decode_graphs.SEGMENTS * b, dtype=np.int32)
    decode_graphs.fill_step(host, b, [1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3], [4, 5, 6, 7], 99,
                           np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), 50)
    assert [t.tolist() for t in decode_graphs.read_stage(torch.from_numpy(host), b)[:4]] == [
        [1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3], [4, 5, 6, 7]]
    stage = torch.full((decode_graphs.SEGMENTS * b,), 13, dtype=torch.int32)
    decode_graphs.fill_padding(stage, b, 99, 50)
    ids, pos, src, rows, at, vals = (t.tolist() for t in decode_graphs.read_stage(stage, b))
    assert ids == pos == vals == [0] * b and src == [-1] * b and rows == [99] * b and at == [50] * b
