"""The per-row checks the GPU kernel tests rely on (tests/helpers/kernel_oracle.py), proven on the CPU: the exact
answer of position-encoded inputs matches the torch oracle, survives rounding to the kernels' dtypes, and one key
dropped or counted twice at a block or split boundary is caught in every row that sees it, where a whole-batch
relative error lets it pass."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention import AttentionParams
from hf_paged.attention.backends._torch import paged_attention_reference

from kernel_oracle import (
    assert_rows_close,
    exact_position_means,
    flash_rounded,
    position_allowance,
    position_step,
    random_allowance,
    key_ranges,
    row_errors,
    row_sequences,
    sparse_allowance,
)
from paged_steps import make_paged_step

# (cached prefix lengths, new-token counts): a decode step and an extend step, contexts across many blocks/splits
STEPS = {"decode": ([0, 15, 16, 63, 200, 300], [1, 1, 1, 1, 1, 1]), "extend": ([0, 47, 130], [70, 33, 64])}
SPLIT = 64  # a decode split length and the prefill kernel's key tile


WINDOWS = [0, 1, 5, 50]  # none, only the row's own key, less than a block, across blocks and splits


def oracle(meta, query, num_heads: int, head_dim: int, window: int = 0, softcap: float | None = None) -> torch.Tensor:
    k_cache, v_cache = meta.kv_caches[0]
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=window or None, softcap=softcap)
    return paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                     compute_dtype=torch.float64)


def boundary_positions(seq_len: int, block_size: int, window_edges: list[int]) -> list[int]:
    """Key positions at the edges of blocks, of SPLIT-token splits / tiles and of the rows' windows."""
    edges = {p for step in (block_size, SPLIT) for start in range(0, seq_len, step) for p in (start, start - 1)}
    edges |= {p for first in window_edges for p in (first, first - 1)}
    return sorted(p for p in edges if 0 <= p < seq_len)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("step", STEPS)
def test_exact_answer_matches_the_oracle_and_passes_after_rounding(step: str, block_size: int, dtype: torch.dtype,
                                                                   window: int):
    gen = torch.Generator().manual_seed(block_size)
    meta, query, _, _ = position_step(*STEPS[step], block_size, 8, 2, 64, dtype, gen)
    exact = exact_position_means(meta, 8, 2, 64, window=window)
    assert torch.allclose(oracle(meta, query, 8, 64, window), exact, rtol=0, atol=1e-12)
    # zero keys score 0 under any cap: softcapping leaves the exact answer as it is
    assert torch.allclose(oracle(meta, query, 8, 64, window, softcap=2.0), exact, rtol=0, atol=1e-12)
    assert_rows_close(exact.to(dtype), exact, position_allowance(meta, exact, dtype, window), "rounded exact answer")


@pytest.mark.parametrize("fault", ["drop", "repeat"])
@pytest.mark.parametrize("dtype, window", [(torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 1),
                                           (torch.float16, 5), (torch.bfloat16, 50)],
                         ids=["bf16", "fp16", "bf16-window1", "fp16-window5", "bf16-window50"])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("step", STEPS)
def test_one_key_wrong_at_a_boundary_fails_exactly_the_rows_that_see_it(step, block_size, dtype, fault: str,
                                                                        window: int):
    """At block, split and window edges: a key the row sees fails it, a key outside its window does not."""
    gen = torch.Generator().manual_seed(7)
    meta, _, _, _ = position_step(*STEPS[step], block_size, 8, 2, 64, dtype, gen)
    exact = exact_position_means(meta, 8, 2, 64, window=window)
    allowance = position_allowance(meta, exact, dtype, window)
    seq = row_sequences(meta)
    first, end = key_ranges(meta, window)
    checked = 0
    for b, seq_len in enumerate(meta.seq_lens_k.tolist()):
        firsts = first[seq == b]  # the window edges of the sequence's first and last rows
        for pos in boundary_positions(seq_len, block_size, [int(firsts[0]), int(firsts[-1])]):
            # a faulty kernel's output
            wrong = exact_position_means(meta, 8, 2, 64, window=window, **{fault: {b: pos}}).to(dtype)
            failed = (row_errors(wrong, exact, allowance) > 1).all(dim=1)  # every head of the row fails
            sees = (seq == b) & (first <= pos) & (end > pos)
            if fault == "repeat":
                sees &= end - first > 1  # the only key counted twice averages to itself: no output can show it
            assert torch.equal(failed, sees), (b, pos, failed.nonzero().flatten(), sees.nonzero().flatten())
            checked += 1
    assert checked > 20


def test_a_dropped_key_passes_the_whole_batch_error_but_not_the_rows():
    """Why per-row checks: one key missing from a 700-token context moves the batch's relative error far less than
    the bf16 tolerance the grid tests use (1e-2)."""
    gen = torch.Generator().manual_seed(3)
    meta, _, _, _ = position_step([699, 40], [1, 1], 16, 8, 2, 64, torch.bfloat16, gen)
    exact = exact_position_means(meta, 8, 2, 64)
    wrong = exact_position_means(meta, 8, 2, 64, drop={0: 320}).to(torch.bfloat16)
    whole = ((wrong.double() - exact).norm() / exact.norm()).item()
    assert whole < 1e-2
    assert (row_errors(wrong, exact, position_allowance(meta, exact, torch.bfloat16))[0] > 1).all()


def test_random_rows_pass_after_rounding_and_one_bad_row_fails():
    gen = torch.Generator().manual_seed(5)
    meta, _, _ = make_paged_step([0, 300, 5], [40, 1, 17], 16, 2, 64, torch.bfloat16, gen)
    query = torch.randn(int(meta.cu_seqlens_q[-1]), 8, 64, generator=gen).to(torch.bfloat16)
    expected = oracle(meta, query, 8, 64)
    allowance = random_allowance(expected, 2e-2)
    assert_rows_close(expected.to(torch.bfloat16), expected, allowance, "rounded oracle")
    wrong = expected.clone()
    wrong[41, 3] *= 1.1  # one row of one head 10% off
    errors = row_errors(wrong, expected, allowance)
    assert (errors > 1).nonzero().tolist() == [[41, 3]]


def one_hot_step(head_dim: int, swap_keys: tuple[int, int] | None = None):
    """The step of the GPU one-hot test (test_prefill_wgmma_gpu.py): random queries and keys, the value of key j one-hot
    at dimension j mod head_dim. ``swap_keys`` exchanges two keys of sequence 0 (a kernel reading K rows out of
    order)."""
    gen = torch.Generator().manual_seed(head_dim)
    meta, _, _ = make_paged_step([0, 200], [300, 57], 16, 1, head_dim, torch.bfloat16, gen)
    k_cache, v_cache = meta.kv_caches[0]
    flat_k, flat_v = k_cache.view(-1, 1, head_dim), v_cache.view(-1, 1, head_dim)
    for b, total in enumerate(meta.seq_lens_k.tolist()):
        pos = torch.arange(total)
        slots = meta.block_tables[b, pos // 16].long() * 16 + pos % 16
        flat_v[slots, 0] = torch.nn.functional.one_hot(pos % head_dim, head_dim).to(v_cache.dtype)
        if swap_keys is not None and b == 0:
            i, j = slots[list(swap_keys)].tolist()
            flat_k[[i, j]] = flat_k[[j, i]]
    query = torch.randn(357, 8, head_dim, generator=gen).to(torch.bfloat16)
    return meta, query


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_one_hot_rows_pass_a_rounded_correct_kernel_and_fail_keys_read_out_of_order(head_dim: int):
    """The sparse allowance passes what a correct flash-style kernel computes (P and the output rounded to bf16),
    which the rms-only allowance fails at head_dim 256; two keys read in each other's place fail exactly the rows
    that see one of them."""
    meta, query = one_hot_step(head_dim)
    expected = oracle(meta, query, 8, head_dim)
    rounded = flash_rounded(query, meta, head_dim**-0.5, torch.bfloat16)
    assert_rows_close(rounded, expected, sparse_allowance(expected, torch.bfloat16, 4e-2), "rounded kernel")
    if head_dim == 256:
        assert (row_errors(rounded, expected, random_allowance(expected, 4e-2)) > 1).any()
    swapped, _ = one_hot_step(head_dim, swap_keys=(40, 41))
    wrong = flash_rounded(query, swapped, head_dim**-0.5, torch.bfloat16)
    failed = (row_errors(wrong, expected, sparse_allowance(expected, torch.bfloat16, 4e-2)) > 1).any(dim=1)
    # rows from 40 on see key 40's slot, which now holds key 41; sequence 1 is untouched
    assert torch.equal(failed, torch.arange(357).ge(40) & torch.arange(357).lt(300))
