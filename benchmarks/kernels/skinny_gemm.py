"""The skinny linear kernel against cuBLAS (``F.linear``) at decode row counts: time per call, GB/s, % of copy
bandwidth.

Shapes: every distinct linear of Llama-3.2-1B and Llama-3.1-8B (q/o, k/v, gate/up, down, lm_head) and of one rank of
Llama-3.1-8B split over two GPUs by tensor parallelism (``8b-tp2``: q 2048, k/v 512 and gate/up 7168 rows of K=4096,
o 4096 x 2048, down 4096 x 7168, and lm_head's 64128-row half of the vocabulary: transformers' Llama plan splits it
by columns and gathers the logits), ``--rows`` (default 1, 2, 4, 8; up to 8) rows of x, ``--dtype``
(default bf16), with no bias (as in Llama). "skinny" is skinny_gemm.cu, called directly.

Each time is of a CUDA graph of ``calls`` launches cycling through enough copies of the weight to span twice the L2
cache, so that every call reads its weight from DRAM as in a decode step, and no host launch cost is timed; time
per call = median over ``--replays`` replays of (replay time / calls), after warm-up replays
(``hf_paged.bench.time_calls``). Bytes moved = weight + x + out; GB/s = bytes / time; "% copy" = that over the copy
bandwidth of the same run (``hf_paged.bench.copy_bandwidth``: the best of a 1 GiB device-to-device copy and a copy
kernel, a read plus a write per byte). Both results are checked against each
other first. Grouped rows time the products that share x (q+k+v, gate+up): cuBLAS = one ``F.linear`` per weight,
skinny = one grouped launch, each in the same graph setup (a "call" is the whole group).
The summary adds up one decode step's linears (per layer: each shape its count, e.g. 8B's q/o 2, k/v 2, gate/up 2,
down 1; then lm_head): all on cuBLAS, all single kernel launches, and as the engine runs them (q+k+v and gate+up
grouped, the other products per the single op's size rule, ``kernel_wins``).
Progress lines go to stdout as it runs, the table last; ``--json`` writes every row and the settings.

    python -m benchmarks.kernels.skinny_gemm [--models 1b,8b,8b-tp2] [--rows 1,2,4,8] [--dtype bf16] [--replays 20]
        [--extra] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_paged.bench import copy_bandwidth, time_calls
from hf_paged.kernels import unavailable_reason
from hf_paged.kernels._skinny import MAX_ROWS, kernel_wins


# shape: (N, K, calls per layer); 0 for lm_head, called once per step
MODELS = {
    "1b": dict(name="Llama-3.2-1B", layers=16, shapes={"q/o": (2048, 2048, 2), "k/v": (512, 2048, 2),
                                                       "gate/up": (8192, 2048, 2), "down": (2048, 8192, 1),
                                                       "lm_head": (128256, 2048, 0)}),
    "8b": dict(name="Llama-3.1-8B", layers=32, shapes={"q/o": (4096, 4096, 2), "k/v": (1024, 4096, 2),
                                                       "gate/up": (14336, 4096, 2), "down": (4096, 14336, 1),
                                                       "lm_head": (128256, 4096, 0)}),
    "8b-tp2": dict(name="Llama-3.1-8B TP-2 rank", layers=32, shapes={"q": (2048, 4096, 1), "k/v": (512, 4096, 2),
                                                                     "o": (4096, 2048, 1), "gate/up": (7168, 4096, 2),
                                                                     "down": (4096, 7168, 1),
                                                                     "lm_head": (64128, 4096, 0)}),
}
# grouped products: name -> the shapes (of MODELS[...]["shapes"]) sharing x, once per layer each; q is "q/o" where
# the model's q and o have one shape
GROUPS = {"q+k+v": ("q", "k/v", "k/v"), "gate+up": ("gate/up", "gate/up")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def group_shapes(spec: dict, group: str) -> tuple[str, ...]:
    """The model's shape names of one group's products."""
    return tuple("q/o" if name == "q" and "q" not in spec["shapes"] else name for name in GROUPS[group])


def _cublas_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in weights]


# the kernel itself (the routed op would send small single products to cuBLAS)
def _skinny(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.hf_paged.skinny_gemm(x, weight, None)


def _skinny_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch.ops.hf_paged.skinny_gemm_group(x, weights, [None] * len(weights))


SYSTEMS = {"cublas": F.linear, "skinny": _skinny}
GROUP_SYSTEMS = {"cublas": _cublas_group, "skinny": _skinny_group}
MIN_CALLS = 20


def _with_blas(library: str, fn):
    """``fn`` with torch's preferred BLAS library set to ``library`` for the call (restored after): under capture the
    graph keeps the kernels it chose."""
    def call(x, w):
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn(x, w)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return call


def extra_systems(grouped: bool, weights: list) -> dict:
    """--extra: ``cublaslt`` (the cuBLAS products with torch's cuBLASLt path) and, for a group, ``packed``: one cuBLAS
    product over a copy of the group's weights laid end to end, its output split by a copy, as the tensor-parallel
    engine runs packed q/k/v (``hf_paged.kernels._skinny.packed_rows``)."""
    out = {"cublaslt": _with_blas("cublaslt", _cublas_group if grouped else F.linear)}
    if grouped:
        packed = {id(ws[0]): torch.cat(ws) for ws in weights}
        sizes = [w.shape[0] for w in weights[0]]
        out["packed"] = lambda x, ws: torch.split_with_sizes_copy(F.linear(x, packed[id(ws[0])]), sizes, dim=-1)
    return out


def group_copies(widths: list[int], k: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Enough distinct sets of weights ``[N_i, K]`` to span twice the L2 cache (at least two), scaled like a trained
    layer's."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    count = max(2, math.ceil(2 * l2 / (sum(widths) * k * dtype.itemsize)) + 1)
    return [[torch.empty(n, k, device="cuda", dtype=dtype).normal_(0, k**-0.5) for n in widths] for _ in range(count)]


def time_per_call(fn, x: torch.Tensor, weights: list, replays: int) -> float:
    """Seconds per call (``hf_paged.bench.time_calls``): the median over ``replays`` replays of a CUDA graph of at
    least :data:`MIN_CALLS` calls cycling through ``weights`` (tensors, or lists of them for a group)."""
    return time_calls([functools.partial(fn, x, w) for w in weights], min_calls=MIN_CALLS, reps=replays).median_s


def measure(model: str, shape: str, rows: int, weights: list, args, copy_bw: float) -> dict:
    """One row: ``weights`` holds copies of one weight, or of one group's weights (a list each)."""
    grouped = isinstance(weights[0], list)
    systems = GROUP_SYSTEMS if grouped else SYSTEMS
    first = weights[0] if grouped else [weights[0]]
    n, k = sum(w.shape[0] for w in first), first[0].shape[1]
    x = torch.randn(rows, k, device="cuda").to(first[0].dtype)
    want = torch.cat([F.linear(x, w) for w in first], 1).float()
    got = torch.cat(systems["skinny"](x, weights[0]) if grouped else [systems["skinny"](x, weights[0])], 1).float()
    error = float(((got - want).abs() / (want.abs() + 1)).max())
    itemsize = first[0].element_size()
    moved = (n * k + rows * k + rows * n) * itemsize
    row = dict(model=model, shape=shape, n=n, k=k, rows=rows, dtype=args.dtype, bytes=moved, max_rel_diff=error,
               small=not kernel_wins(first[0]))
    if args.extra:
        systems = {**systems, **extra_systems(grouped, weights)}
    for system, fn in systems.items():
        seconds = time_per_call(fn, x, weights, args.replays)
        row[f"{system}_us"] = round(seconds * 1e6, 2)
        row[f"{system}_gbs"] = round(moved / seconds / 1e9, 1)
        row[f"{system}_pct_copy"] = round(100 * moved / seconds / copy_bw, 1)
    row["speedup"] = round(row["cublas_us"] / row["skinny_us"], 3)
    return row


def step_totals(rows: list[dict], models: list[str], row_counts: list[int]) -> list[str]:
    """One decode step's linears per model and row count, in microseconds: all on cuBLAS, all on single kernel
    launches, and as the engine runs them (groups on one launch each, the other products per the size rule)."""
    lines = []
    for key in models:
        spec = MODELS[key]
        for m in row_counts:
            at = {r["shape"]: r for r in rows if r["model"] == spec["name"] and r["rows"] == m}
            total = {s: 0.0 for s in SYSTEMS}
            for shape, (_, _, per_layer) in spec["shapes"].items():
                for s in SYSTEMS:
                    total[s] += (spec["layers"] * per_layer if per_layer else 1) * at[shape][f"{s}_us"]
            line = (f"{spec['name']} M={m}: a decode step's linears take {total['cublas']:.0f} us with cuBLAS, "
                    f"{total['skinny']:.0f} us with single skinny launches")
            if all(g in at for g in GROUPS):
                grouped = [name for g in GROUPS for name in group_shapes(spec, g)]
                engine = spec["layers"] * sum(at[g]["skinny_us"] for g in GROUPS)
                for shape, (_, _, per_layer) in spec["shapes"].items():
                    single = at[shape]["cublas_us" if at[shape]["small"] else "skinny_us"]
                    calls = spec["layers"] * (per_layer - grouped.count(shape)) if per_layer else 1
                    engine += calls * single
                line += f", {engine:.0f} us as the engine runs them (grouped)"
            lines.append(line)
    return lines


def table(rows: list[dict]) -> str:
    extra = [name for name in ("cublaslt", "packed") if any(f"{name}_us" in r for r in rows)]
    lines = ["| model | shape | N x K | M | cuBLAS us | skinny us | speedup | cuBLAS GB/s | skinny GB/s "
             "| cuBLAS % copy | skinny % copy |" + "".join(f" {name} us |" for name in extra),
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    lines += [f"| {r['model']} | {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['cublas_us']:.1f} | "
              f"{r['skinny_us']:.1f} | {r['speedup']:.2f} | {r['cublas_gbs']:.0f} | {r['skinny_gbs']:.0f} | "
              f"{r['cublas_pct_copy']:.0f} | {r['skinny_pct_copy']:.0f} |"
              + "".join(f" {r[f'{name}_us']:.1f} |" if f"{name}_us" in r else " - |" for name in extra) for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,8b", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--rows", default="1,2,4,8", help=f"comma-separated row counts of x (1 to {MAX_ROWS})")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays per measurement")
    parser.add_argument("--extra", action="store_true",
                        help="also time cuBLAS through torch's cuBLASLt path, and each group as one product over "
                             "its weights packed end to end (columns cublaslt / packed)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.rows = [int(r) for r in args.rows.split(",") if r]
    if set(args.models) - set(MODELS):
        parser.error(f"unknown models {sorted(set(args.models) - set(MODELS))}; choose from {sorted(MODELS)}")
    if not all(0 < m <= MAX_ROWS for m in args.rows):
        parser.error(f"--rows must be 1 to {MAX_ROWS} (the skinny kernel serves no more), got {args.rows}")
    return args


def report(rows: list[dict], args, device: str, copy_bw: float) -> None:
    """Print the last row as it comes and rewrite the JSON file with every row so far."""
    row = rows[-1]
    extra = "".join(f", {name} {row[f'{name}_us']:.1f} us ({row[f'{name}_pct_copy']:.0f}% copy)"
                    for name in ("cublaslt", "packed") if f"{name}_us" in row)
    print(f"{row['model']} {row['shape']} {row['n']}x{row['k']} M={row['rows']}: cuBLAS {row['cublas_us']:.1f} us "
          f"({row['cublas_gbs']:.0f} GB/s, {row['cublas_pct_copy']:.0f}% copy), skinny {row['skinny_us']:.1f} us "
          f"({row['skinny_gbs']:.0f} GB/s, {row['skinny_pct_copy']:.0f}% copy){extra}, max rel diff "
          f"{row['max_rel_diff']:.1e}", flush=True)
    if args.json is not None:
        settings = {**{name: str(v) for name, v in vars(args).items()}, "device": device,
                    "json": args.json.name,  # the file's name only: where it was written is the machine's own
                    "copy_bandwidth_gbs": round(copy_bw / 1e9, 1)}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels/skinny_gemm.py needs a CUDA GPU: it times CUDA kernels")
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the hf_paged kernels are unavailable here: {reason}")
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()[0]
    print(f"{device}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (1 GiB device-to-device, read + write)", flush=True)
    rows = []
    for key in args.models:
        spec = MODELS[key]
        products = {shape: [shape] for shape in spec["shapes"]} | {g: group_shapes(spec, g) for g in GROUPS}
        for name, shapes in products.items():
            widths, k = [spec["shapes"][shape][0] for shape in shapes], spec["shapes"][shapes[0]][1]
            sets = group_copies(widths, k, DTYPES[args.dtype])
            weights = sets if name in GROUPS else [weights[0] for weights in sets]
            for m in args.rows:
                rows.append(measure(spec["name"], name, m, weights, args, copy_bw))
                report(rows, args, device, copy_bw)
            del weights, sets
            torch.cuda.empty_cache()
    print("\n".join(step_totals(rows, args.models, args.rows)))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
