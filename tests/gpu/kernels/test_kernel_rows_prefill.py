"""The prefill kernel judged row by row on inputs whose answer is exact (tests/gpu/kernel_rows.py): query tiles of
64/128 rows and key tiles of 64, full and ragged, after cached prefixes ending on and around tile and block edges, at
block sizes 16/48/256 and each tile configuration compiled for the head size. This file: head sizes 64, 128, 256
(and float32 at 128); test_kernel_rows_prefill_sizes.py: the other compiled sizes.
"""

from __future__ import annotations

import pytest
import torch

from kernel_rows import DTYPE_HEAD_DIMS, check_prefill_rows

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS.values(), ids=DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_prefill_rows_are_exact_means(block_size: int, dtype: torch.dtype, head_dim: int, heads):
    check_prefill_rows(heads, dtype, head_dim, block_size)
