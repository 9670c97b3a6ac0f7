"""The wgmma prefill's shared-memory layout against the PTX ISA's model of what a descriptor reads, on the CPU.

The kernel writes Q, K and V tiles with ``wgmma::sw128_offset`` and hands the tensor cores descriptors built in
``qk_tile`` / ``pv_tile`` (csrc/paged_prefill_wgmma.cuh). Here both sides are modelled in Python: the write layout
(mirrored from wgmma.cuh), and the hardware's reading of a descriptor (the canonical 128-byte-swizzled layouts of the
PTX ISA, "Shared Memory Matrix Layout": K-major ((8, m), (T, 2k)) : ((8T, SBO), (1, T)), MN-major ((T, 8, m), (8, k)) :
((1, T, LBO), (8T, SBO)), T = 8 16-bit elements, then the swizzle: byte address bits 4-6 XOR bits 7-9). Each k step
of each product must read exactly the matrix elements the kernel means. This checks the kernel's index arithmetic
against that reading of the spec, not the spec against the hardware (the GPU tests do that)."""

from __future__ import annotations

import pytest


def sw128_offset(row: int, chunk: int, rows: int) -> int:
    """Byte offset of (row, 16-byte chunk) in a tile of ``rows`` rows: mirrors wgmma::sw128_offset."""
    return ((chunk >> 3) * rows + row) * 128 + (((chunk & 7) ^ (row & 7)) << 4)


def write_tile(rows: int, cols: int, base: int, memory: dict[int, tuple[int, int]]) -> None:
    """Store element (r, c) of a [rows, cols] 16-bit tile at its address, as the kernel's cp.async copies do."""
    for r in range(rows):
        for c in range(cols):
            memory[base + sw128_offset(r, c // 8, rows) + (c % 8) * 2] = (r, c)


def swizzle(addr: int) -> int:
    return addr ^ (((addr >> 7) & 7) << 4)


def read_k_major(memory, start: int, sbo: int, rows: int) -> list[list[tuple[int, int]]]:
    """[rows][16] elements a K-major operand descriptor (start, SBO) yields for one k16 step."""
    return [[memory[swizzle(start + (m % 8) * 128 + (m // 8) * sbo + k * 2)] for k in range(16)]
            for m in range(rows)]


def read_mn_major(memory, start: int, lbo: int, sbo: int, cols: int) -> list[list[tuple[int, int]]]:
    """[16][cols] elements (k, n) an MN-major operand descriptor (start, LBO, SBO) yields for one k16 step."""
    return [[memory[swizzle(start + (n % 64) * 2 + (n // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo)]
             for n in range(cols)] for k in range(16)]


def traits(head_dim: int) -> tuple[int, int]:
    """(kBlockM, kBlockN) of prefill_wgmma::Traits."""
    return 128, (128 if head_dim <= 128 else 64)


HEAD_DIMS = [32, 64, 80, 96, 112, 128, 160, 192, 256]  # kernels.prefill.WGMMA_HEAD_DIMS


def test_the_model_covers_the_compiled_head_sizes():
    from hf_paged.kernels._prefill import WGMMA_HEAD_DIMS
    assert tuple(HEAD_DIMS) == WGMMA_HEAD_DIMS


def panels(head_dim: int) -> int:
    """64-column panels of a tile (Traits::kPanels): the last one partly used below a multiple of 64."""
    return (head_dim + 63) // 64


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_qk_descriptors_read_q_and_k_rows(head_dim: int):
    """S = Q K^T: warpgroup wg's A is Q rows 64 wg .. + 63, B is every key row, both over head_dim 16 kk .. + 15."""
    block_m, block_n = traits(head_dim)
    memory: dict[int, tuple[int, int]] = {}
    q_base, k_base = 0, block_m * panels(head_dim) * 128  # Traits::kKOffset, 1024-aligned
    write_tile(block_m, head_dim, q_base, memory)
    write_tile(block_n, head_dim, k_base, memory)
    for wg in range(2):
        q_rows = q_base + wg * 64 * 128
        for kk in range(head_dim // 16):
            col = (kk & 3) * 32
            a = read_k_major(memory, q_rows + (kk >> 2) * block_m * 128 + col, 1024, 64)
            assert a == [[(64 * wg + m, 16 * kk + k) for k in range(16)] for m in range(64)], (wg, kk)
            b = read_k_major(memory, k_base + (kk >> 2) * block_n * 128 + col, 1024, block_n)
            assert b == [[(n, 16 * kk + k) for k in range(16)] for n in range(block_n)], kk


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_pv_descriptor_reads_v_transposed(head_dim: int):
    """O += P V: B of k step kk is V rows (keys) 16 kk .. + 15 by every head_dim column, N-major."""
    _, block_n = traits(head_dim)
    memory: dict[int, tuple[int, int]] = {}
    write_tile(block_n, head_dim, 0, memory)
    for kk in range(block_n // 16):
        b = read_mn_major(memory, kk * 16 * 128, block_n * 128, 1024, head_dim)
        assert b == [[(16 * kk + k, n) for n in range(head_dim)] for k in range(16)], kk


def test_tiles_fill_whole_swizzle_atoms():
    """Every panel is a whole number of 1024-byte swizzle atoms, so tiles laid end to end from a 1024-aligned base keep
    every descriptor's base offset 0; the writes cover each tile's used bytes exactly once, and below a multiple of 64
    columns the last panel's unused part is a whole column band (rows keep their first head_dim % 64 columns), so
    no k step or output column reads it."""
    for head_dim in HEAD_DIMS:
        block_m, block_n = traits(head_dim)
        for rows in (block_m, block_n, 64):
            assert rows * 128 % 1024 == 0
            offsets = {sw128_offset(r, c, rows) for r in range(rows) for c in range(head_dim // 8)}
            assert len(offsets) == rows * head_dim // 8
            assert all(0 <= o < rows * panels(head_dim) * 128 for o in offsets)
            if head_dim % 64 == 0:
                assert offsets == set(range(0, rows * head_dim * 2, 16))
            else:  # the last panel: per row, the swizzled places of its first (head_dim % 64) / 8 chunks
                last = (panels(head_dim) - 1) * rows * 128
                used = head_dim % 64 // 8
                for r in range(rows):
                    start = last + r * 128
                    row_chunks = {(o - start) // 16 for o in offsets if start <= o < start + 128}
                    assert row_chunks == {c ^ (r & 7) for c in range(used)}
