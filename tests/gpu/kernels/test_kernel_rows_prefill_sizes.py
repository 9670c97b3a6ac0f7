"""The prefill kernel's exact-answer rows (as test_kernel_rows_prefill.py) at the other compiled head sizes: the padded
shared-memory pitch (80, 96, 112, 160), 32 and 192, and float32 at 80 and 192 (the CUDA-core path's padded lanes).
"""

from __future__ import annotations

import pytest
import torch

from kernel_rows import NEW_DTYPE_HEAD_DIMS, check_prefill_rows

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa-32/8", "mqa-8/1"])
@pytest.mark.parametrize("dtype, head_dim", NEW_DTYPE_HEAD_DIMS.values(), ids=NEW_DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_prefill_rows_are_exact_means_at_other_head_sizes(block_size: int, dtype: torch.dtype, head_dim: int, heads):
    check_prefill_rows(heads, dtype, head_dim, block_size)
