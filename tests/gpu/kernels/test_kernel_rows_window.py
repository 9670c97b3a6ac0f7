"""Sliding windows in both kernels, judged row by row on inputs whose answer is exact (tests/gpu/kernel_rows.py): each
row's output is the mean of its last ``window`` keys' values exactly. Windows of 1 and 5 (inside one block), 100 (no
multiple of any block size or tile), 700 (across decode splits and prefill tiles) and longer than every context; the
decode contexts end around every block and split edge (forced splits 64/512 and the heuristic, max_seq_len also at the
table's capacity, as under a CUDA graph), the prefill steps have cached prefixes around tile and block edges and run
every tile configuration. Half the cases also softcap (zero keys score 0 under any cap: the answer stays exact).
"""

from __future__ import annotations

import pytest
import torch

from kernel_rows import WINDOWS, check_decode_rows, check_prefill_rows

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DTYPE_HEAD_DIMS = {"bf16-d128": (torch.bfloat16, 128), "fp16-d64": (torch.float16, 64),
                   "bf16-d80": (torch.bfloat16, 80), "fp32-d128": (torch.float32, 128)}
HEADS_SOFTCAP = {"gqa-32/8": ((32, 8), 0.0), "mqa-8/1-softcap30": ((8, 1), 30.0)}


@pytest.mark.parametrize("heads, softcap", HEADS_SOFTCAP.values(), ids=HEADS_SOFTCAP.keys())
@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS.values(), ids=DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48])
def test_decode_rows_are_window_means(block_size: int, dtype: torch.dtype, head_dim: int, heads, softcap: float):
    check_decode_rows(heads, dtype, head_dim, block_size, split_lens=(0, 64, 512), windows=tuple(WINDOWS),
                      softcap=softcap)


@pytest.mark.parametrize("heads, softcap", HEADS_SOFTCAP.values(), ids=HEADS_SOFTCAP.keys())
@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS.values(), ids=DTYPE_HEAD_DIMS.keys())
@pytest.mark.parametrize("block_size", [16, 48])
def test_prefill_rows_are_window_means(block_size: int, dtype: torch.dtype, head_dim: int, heads, softcap: float):
    check_prefill_rows(heads, dtype, head_dim, block_size, windows=tuple(WINDOWS), softcap=softcap)
