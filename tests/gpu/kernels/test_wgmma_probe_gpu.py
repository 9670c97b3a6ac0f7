"""The wgmma building blocks of the Hopper prefill (``csrc/wgmma.cuh``), one product on one warpgroup, against a
float64 torch matmul, on a compute capability 9.0 GPU (skipped elsewhere, and without nvcc / ninja).

Run it before ``test_prefill_wgmma_gpu.py``: it tells which layout is wrong when the kernels fail. ``wgmma_probe.cu``
(built here for sm_90a with torch's extension loader, apart from the library) computes D[64 x N] = A[64 x K] B[K x N]
in K / 16 wgmma steps with the kernels' own descriptors, in the two forms the prefill uses:

- ``ss`` (as S = Q K^T): A and B^T both K-major in shared memory, written with ``sw128_offset``;
- ``rs`` (as O += P V): A from registers (the m16n8k16 A fragment), B MN-major (rows = the contraction), read
  transposed.

Integer-valued inputs make the products exact. On a mismatch the test maps, for every element of D, which element of
A and of B the hardware actually read (one-hot partners, row and column numbers as values), names the pattern
(transposed, other 64-column panel, other 8-row group, 16-byte chunks permuted, zeros from unwritten shared memory,
...), and for ``rs`` retries with LBO and SBO swapped.
"""

from __future__ import annotations

import collections
import functools
import shutil
from pathlib import Path

import pytest
import torch

if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("wgmma (sm_90a) runs on compute capability 9.0 (Hopper) only", allow_module_level=True)

from torch.utils import cpp_extension  # noqa: E402

if not (cpp_extension.CUDA_HOME and (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists()) \
        and shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)
if not cpp_extension.is_ninja_available():
    pytest.skip("ninja not installed", allow_module_level=True)

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "hf_paged" / "csrc"
SS, RS = 0, 1
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (form, N, K): N the instruction's n (the prefill's kBlockN for ss, head_dim for rs), K the contraction (16: one
# step; 64: one 64-column panel for ss; 128: two panels for ss, 8-row groups up to the V tile's 128 rows for rs).
# Head sizes that are not a multiple of 64 (32, 80, 96, 112, 160, 192) end in a partly used panel: ss with K =
# head_dim (its last k steps in that panel), rs with N = head_dim (the product's last columns there).
PARTIAL = (32, 80, 96, 112, 160, 192)
CASES = [(SS, n, k) for n in (64, 128, 256) for k in (16, 64, 128)]
CASES += [(SS, n, k) for n in (64, 128) for k in PARTIAL]
CASES += [(RS, n, k) for n in (64, 128, 256, *PARTIAL) for k in (16, 64, 128) if k <= (128 if n <= 128 else 64)]


@functools.cache
def probe_module():
    return cpp_extension.load(name="hf_paged_wgmma_probe", sources=[str(HERE / "wgmma_probe.cu")],
                              extra_include_paths=[str(CSRC)],
                              extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])


def run(form: int, a: torch.Tensor, b: torch.Tensor, row0: int = 0, lbo: int = 0, sbo: int = 0) -> torch.Tensor:
    """D = a[row0 : row0 + 64] @ b on the tensor cores (a: [128, K], b: [K, N]); lbo / sbo (bytes) override the
    kernels' descriptor fields when non-zero."""
    d = torch.full((64, b.shape[1]), float("nan"), device="cuda")  # every element must be written
    b_arg = b.t() if form == SS else b  # ss takes B^T ([N, K], K-major like K), rs B itself ([K, N], like V)
    probe_module().probe(a.cuda().contiguous(), b_arg.cuda().contiguous(), d, form, row0, lbo, sbo)
    torch.cuda.synchronize()
    return d.cpu().double()


def read_map(form: int, dtype, n: int, k: int, row0: int, operand: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of the A (or B) element that each D element was read from, the other operand one-hot: A's row /
    column numbers as values against B[j, n] = (j == n % K); B's against A[row0 + m, j] = (j == m % K). -1: a zero
    was read; a non-integer or out-of-range number: not one element (the one-hot partner was misread too)."""
    m_idx, n_idx = torch.arange(64)[:, None], torch.arange(n)[None, :]
    if operand == "A":
        one_hot = (torch.arange(k)[:, None] == n_idx % k).to(dtype)
        ids = [run(form, v.to(dtype), one_hot, row0, **kw) for v in
               (torch.arange(128)[:, None].expand(128, k) + 1.0, torch.arange(k)[None, :].expand(128, k) + 1.0)]
    else:
        one_hot = torch.zeros(128, k, dtype=dtype)
        one_hot[row0:row0 + 64] = (torch.arange(k)[None, :] == m_idx % k).to(dtype)
        ids = [run(form, one_hot, v.to(dtype), row0, **kw) for v in
               (torch.arange(k)[:, None].expand(k, n) + 1.0, torch.arange(n)[None, :].expand(k, n) + 1.0)]
    return ids[0] - 1, ids[1] - 1


def wrong_reads(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (got[0] != want[0]) | (got[1] != want[1])


def describe(operand: str, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str:
    """One paragraph on where the reads of one operand went wrong."""
    (gr, gc), (wr, wc) = got, want
    wrong = wrong_reads(got, want)
    if not wrong.any():
        return f"{operand}: every element read from its place"
    gr, gc, wr, wc = gr[wrong], gc[wrong], wr[wrong], wc[wrong]
    single = (gr == gr.round()) & (gc == gc.round()) & (gr >= 0) & (gc >= 0)
    hints = []
    if (gr.isnan() | gc.isnan()).any():
        hints.append("NaN: D elements never written (the accumulator layout?)")
    if ((gr == -1) & (gc == -1)).any():
        hints.append(f"{int(((gr == -1) & (gc == -1)).sum())} zeros: read shared memory nothing was written to")
    if (~single & ~((gr == -1) & (gc == -1)) & ~gr.isnan() & ~gc.isnan()).any():
        hints.append("sums or fractions: not one element each (the other operand's reads are wrong too)")
    s = single
    if s.any():
        checks = {
            "transposed (row and column swapped)": (gr == wc) & (gc == wr),
            "right row, column in another 64-column panel (panel stride: LBO / the panel offset)":
                (gr == wr) & (gc % 64 == wc % 64) & (gc != wc),
            "right row, 16-byte chunks permuted inside the 128-byte row (swizzle phase, or the k-step offset)":
                (gr == wr) & (gc // 64 == wc // 64) & (gc % 8 == wc % 8) & (gc != wc),
            "right row, elements permuted inside a 16-byte chunk (register fragment order?)":
                (gr == wr) & (gc // 8 == wc // 8) & (gc != wc),
            "right column, row in another 8-row group (SBO / 8-row group stride)":
                (gc == wc) & (gr % 8 == wr % 8) & (gr != wr),
            "right column, rows permuted inside their 8-row group (swizzle / fragment row order)":
                (gc == wc) & (gr // 8 == wr // 8) & (gr != wr),
        }
        for what, hit in checks.items():
            if hit[s].any():
                hints.append(f"{int(hit[s].sum())} {what}")
        moves = collections.Counter(zip((gr - wr)[s].long().tolist(), (gc - wc)[s].long().tolist()))
        hints.append("commonest (d_row, d_col): " + ", ".join(f"{m}: {c}" for m, c in moves.most_common(3)))
    examples = [f"want {operand}[{int(r)},{int(c)}] got {operand}[{x:g},{y:g}]"
                for r, c, x, y in list(zip(wr.tolist(), wc.tolist(), gr.tolist(), gc.tolist()))[:3]]
    return (f"{operand}: {int(wrong.sum())} of {wrong.numel()} D elements read the wrong element; "
            + "; ".join(hints) + "; e.g. " + "; ".join(examples))


def swapped_is_exact(form: int, dtype, n: int, k: int, row0: int) -> bool:
    """rs with the stride between 64-column panels and between 8-row groups exchanged (LBO = 1024, SBO = the
    panel stride)."""
    a, b = ints((128, k), dtype, 1), ints((k, n), dtype, 2)
    got = run(form, a, b, row0, lbo=1024, sbo=(128 if n <= 128 else 64) * 128)
    return torch.equal(got, a[row0:row0 + 64].double() @ b.double())


def diagnose(form: int, dtype, n: int, k: int, row0: int) -> str:
    m_idx, n_idx = torch.arange(64)[:, None].expand(64, n), torch.arange(n)[None, :].expand(64, n)
    maps = {"A": (read_map(form, dtype, n, k, row0, "A"), (row0 + m_idx, n_idx % k)),
            "B": (read_map(form, dtype, n, k, row0, "B"), (m_idx % k, n_idx))}
    lines = ["(each map holds the other operand one-hot: an operand read wrong garbles the other's map too, so "
             "trust the map with the regular pattern)"]
    lines += [describe(operand, got, want) for operand, (got, want) in maps.items()]
    wrong_a, wrong_b = (wrong_reads(*maps[operand]) for operand in "AB")
    if wrong_a.any() and torch.equal(wrong_a, wrong_b):
        lines.append("A and B wrong at the same D elements: suspect D's register layout (the accumulator fragment, "
                     "or where the probe stores it) before either descriptor")
    if form == RS:
        exact = swapped_is_exact(form, dtype, n, k, row0)
        lines.append(f"rs with LBO and SBO swapped: {'EXACT: swap them in pv_issue' if exact else 'still wrong'}")
    return "\n".join(lines)


def ints(shape, dtype, seed: int) -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def name(form: int, n: int, k: int) -> str:
    return f"{'ss' if form == SS else 'rs'}-n{n}-k{k}"


def wrong_count(form: int, n: int, k: int, dtype) -> tuple[int, int]:
    """(row0, number of wrong D elements) of the first row0 (0, then 64) that gives a wrong product; (0, 0) if none
    does. ss row0 = 64: the second warpgroup's A rows, 64 rows into the tile, as in the prefill."""
    a, b = ints((128, k), dtype, 1), ints((k, n), dtype, 2)
    for row0 in (0, 64):
        got = run(form, a, b, row0)
        bad = int((got != a[row0:row0 + 64].double() @ b.double()).sum())  # integers: exact in fp32 accumulators
        if bad:
            return row0, bad
    return 0, 0


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("form,n,k", CASES, ids=[name(*case) for case in CASES])
def test_wgmma_product_is_exact(form, n, k, dtype):
    row0, bad = wrong_count(form, n, k, dtype)
    if bad:
        pytest.fail(f"{name(form, n, k)} {dtype} row0={row0}: {bad} of {64 * n} elements wrong\n"
                    + diagnose(form, dtype, n, k, row0), pytrace=False)


def test_summary_of_every_case():
    """Runs last: one line per wrong case, so that the pattern across cases shows even when the output is cut."""
    lines = []
    for dtype in DTYPES.values():
        for form, n, k in CASES:
            row0, bad = wrong_count(form, n, k, dtype)
            if bad:
                swap = f"; LBO/SBO swapped: {'EXACT' if swapped_is_exact(form, dtype, n, k, row0) else 'wrong'}" \
                    if form == RS else ""
                lines.append(f"{name(form, n, k)} {dtype} row0={row0}: {bad} of {64 * n} wrong{swap}")
    if lines:
        pytest.fail(f"{len(lines)} of {len(DTYPES) * len(CASES)} cases wrong:\n" + "\n".join(lines), pytrace=False)
