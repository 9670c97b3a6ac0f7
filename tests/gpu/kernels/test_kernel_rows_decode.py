"""The decode kernels judged row by row on inputs whose answer is exact (tests/gpu/kernel_rows.py).

Contexts end on and around every edge of 8/16/48/256-token blocks and of decode splits (forced 64/192/512 and the
heuristic; max_seq_len also at the table's capacity), at head sizes from 32 to 256. Sliding windows are in
test_kernel_rows_window.py, prefill in test_kernel_rows_prefill*.py (one file each so that none runs long).
"""

from __future__ import annotations

import pytest
import torch

from kernel_rows import DTYPE_HEAD_DIMS, NEW_DTYPE_HEAD_DIMS, check_decode_rows

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")


@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (12, 12)], ids=["gqa-32/8", "mqa-8/1", "mha-12/12"])
@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS.values(), ids=DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
def test_decode_rows_are_exact_means(block_size: int, dtype: torch.dtype, head_dim: int, heads):
    check_decode_rows(heads, dtype, head_dim, block_size, split_lens=(0, 64, 192, 512))


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("dtype, head_dim", NEW_DTYPE_HEAD_DIMS.values(), ids=NEW_DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48])
def test_decode_rows_are_exact_means_at_other_head_sizes(block_size: int, dtype: torch.dtype, head_dim: int, heads):
    check_decode_rows(heads, dtype, head_dim, block_size, split_lens=(0, 64, 512))
