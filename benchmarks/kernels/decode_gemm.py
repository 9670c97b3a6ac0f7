"""A decode step's linear layers at batch rows against their roofline: cuBLAS, cuBLASLt and inductor's autotuned GEMMs.

Above 8 rows the engine runs every linear of a decode step on cuBLAS (``F.linear``), q/k/v and gate/up each as one
product over the weights packed end to end. This times those products at ``--rows`` (default 64, 128, 256) rows of
x, each against its roofline max(FLOPs / matrix rate, bytes / copy rate), both rates measured in the same run as
``benchmarks/e2e/roofline.py`` measures them (a bf16 8192^3 product; a 4 GiB device-to-device copy, read and write
counted; the best of 5 each). Systems:
  cublas     ``F.linear``, as the engine's compiled layers call it
  cublaslt   the same through torch's cuBLASLt path (``torch.backends.cuda.preferred_blas_library("cublaslt")``)
  splitk2, splitk4  split-K on cuBLAS: x and the weight cut into 2 (4) slices along K, one strided-batched product
             over the slices with float32 partials (``torch.bmm(..., out_dtype=torch.float32)``), summed and cast
             back: more output tiles for the card's SMs at a second, small kernel's cost (inside a compiled layer the
             sum would fuse into the next elementwise kernel; here it is timed as its own kernel)
  autotuned  at the row counts of ``--autotune`` (default none): the product compiled alone with
             ``torch.compile(mode="max-autotune-no-cudagraphs")``, inductor's Triton GEMM templates benchmarked
             against cuBLAS and the fastest kept (about 20-30 s of tuning per product and row count)
Products (``--models``): ``1b`` (Llama-3.2-1B: q/k/v 3072 x 2048, o 2048 x 2048, gate/up 16384 x 2048, down 2048 x
8192 per layer, 16 layers; lm_head 128256 x 2048 once per step) and ``8b`` (Llama-3.1-8B, 32 layers); the shapes are
``benchmarks/kernels/skinny_gemm.py``'s.

Each time is of a CUDA graph cycling through enough copies of the weight to span twice the L2 cache, as
``benchmarks/kernels/skinny_gemm.py`` times (every call reads its weight from DRAM, no host launch cost). Each system's
output is checked against a float32 product first. The summary adds one decode step's products per model and row count.
Progress lines go to stdout as it runs, the table last; ``--json`` writes every row, the card, the versions and the
date.

    python -m benchmarks.kernels.decode_gemm [--models 1b] [--rows 64,128,256] [--autotune 256] [--replays 20]
        [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.e2e.roofline import measure_rates
from benchmarks.kernels import skinny_gemm
from benchmarks.kernels.skinny_gemm import _with_blas, group_copies, time_per_call
from hf_paged.bench import run_header


def engine_products(spec: dict) -> dict[str, tuple[int, int, int]]:
    """A model's decode products as the engine runs them above 8 rows, from ``skinny_gemm``'s shapes of its single
    linears: product -> (N, K, per layer; 0: once per step), q/k/v and gate/up each one product over their packed
    weights."""
    shapes = spec["shapes"]
    (q, k, _), (kv, _, _), (gate_up, _, _) = shapes["q/o"], shapes["k/v"], shapes["gate/up"]
    return {"q+k+v": (q + 2 * kv, k, 1), "o": shapes["q/o"][:2] + (1,), "gate+up": (2 * gate_up, k, 1),
            "down": shapes["down"][:2] + (1,), "lm_head": shapes["lm_head"][:2] + (0,)}


MODELS = {key: dict(name=skinny_gemm.MODELS[key]["name"], layers=skinny_gemm.MODELS[key]["layers"],
                    products=engine_products(skinny_gemm.MODELS[key])) for key in ("1b", "8b")}
DTYPE = torch.bfloat16


def split_k(splits: int):
    """``F.linear`` as one strided-batched product over ``splits`` slices of K, float32 partials summed."""
    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (m, k), n = x.shape, w.shape[0]
        xs = x.view(m, splits, k // splits).transpose(0, 1)  # [splits, m, k/splits], no copy
        ws = w.view(n, splits, k // splits).permute(1, 2, 0)  # [splits, k/splits, n], no copy
        return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(x.dtype)
    return call


def autotuned():
    """A fresh compiled product per shape: dynamo's caches are reset so that no earlier shape's code is reused or
    counted against its recompile limit."""
    torch._dynamo.reset()
    return torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False)


def measure(model: str, product: str, n: int, k: int, rows: int, weights: list[torch.Tensor], args,
            rates: dict) -> dict:
    """One row: every system's time for ``rows`` x ``k`` times the ``n`` x ``k`` weights (copies in ``weights``)."""
    x = torch.randn(rows, k, device="cuda").to(DTYPE)
    want = F.linear(x.float(), weights[0].float())
    flops, moved = 2 * rows * n * k, (n * k + rows * k + rows * n) * DTYPE.itemsize
    roof = max(flops / rates["matrix"], moved / rates["copy"])
    row = dict(model=model, product=product, n=n, k=k, rows=rows, flops=flops, bytes=moved,
               roofline_us=round(roof * 1e6, 2), bound="matrix" if flops / rates["matrix"] > moved / rates["copy"]
               else "copy")
    systems = {"cublas": F.linear, "cublaslt": _with_blas("cublaslt", F.linear), "splitk2": split_k(2),
               "splitk4": split_k(4)}
    if rows in args.autotune:
        systems["autotuned"] = autotuned()
    for system, fn in systems.items():
        got = fn(x, weights[0]).float()
        error = float(((got - want).abs() / (want.abs() + 1)).max())
        if error > 0.05:
            raise AssertionError(f"{system} {product} M={rows}: max relative difference {error:.3g} to float32")
        seconds = time_per_call(fn, x, weights, args.replays)
        row[f"{system}_us"] = round(seconds * 1e6, 2)
        row[f"{system}_pct_roofline"] = round(100 * roof / seconds, 1)
    return row


def step_totals(rows: list[dict], systems: list[str]) -> list[dict]:
    """One decode step's products per model and row count, in microseconds, per system and at the roofline."""
    totals = []
    for spec in MODELS.values():
        for m in sorted({r["rows"] for r in rows if r["model"] == spec["name"]}):
            at = [r for r in rows if r["model"] == spec["name"] and r["rows"] == m]
            if len(at) != len(spec["products"]):
                continue
            calls = {r["product"]: spec["products"][r["product"]][2] * spec["layers"] or 1 for r in at}
            total = {"model": spec["name"], "rows": m}
            for key in ["roofline", *systems]:
                if all(f"{key}_us" in r for r in at):
                    total[f"{key}_us"] = round(sum(calls[r["product"]] * r[f"{key}_us"] for r in at), 1)
            totals.append(total)
    return totals


def table(rows: list[dict], totals: list[dict], systems: list[str]) -> str:
    lines = ["| model | product | N x K | M | roofline us | " + " | ".join(f"{s} us (% roofline)" for s in systems)
             + " |", "|---|---|---|---|---|" + "---|" * len(systems)]
    lines += [f"| {r['model']} | {r['product']} | {r['n']} x {r['k']} | {r['rows']} | {r['roofline_us']:.1f} | "
              + " | ".join(f"{r[f'{s}_us']:.1f} ({r[f'{s}_pct_roofline']:.0f}%)" if f"{s}_us" in r else "-"
                           for s in systems) + " |" for r in rows]
    lines += [f"| {t['model']} | one decode step | | {t['rows']} | {t['roofline_us']:.0f} | "
              + " | ".join(f"{t[f'{s}_us']:.0f} ({100 * t['roofline_us'] / t[f'{s}_us']:.0f}%)" if f"{s}_us" in t
                           else "-" for s in systems) + " |" for t in totals]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--rows", default="64,128,256", help="comma-separated row counts of x")
    parser.add_argument("--autotune", default="", help="comma-separated row counts at which to also time "
                        "inductor's max-autotune product (~25 s of tuning each)")
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays per measurement")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.rows = [int(r) for r in args.rows.split(",") if r]
    args.autotune = [int(r) for r in args.autotune.split(",") if r]
    if set(args.models) - set(MODELS):
        parser.error(f"unknown models {sorted(set(args.models) - set(MODELS))}; choose from {sorted(MODELS)}")
    if not args.rows or min(args.rows) < 1:
        parser.error(f"--rows must be positive integers, got {args.rows}")
    if set(args.autotune) - set(args.rows):
        parser.error(f"--autotune row counts must be among --rows, got {args.autotune} of {args.rows}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels/decode_gemm.py needs a CUDA GPU: it times cuBLAS and Triton kernels")
    card = torch.cuda.get_device_name()
    measured = measure_rates(torch.device("cuda"), DTYPE)
    rates = {"copy": measured["copy_bytes_per_s"], "matrix": measured["matmul_flops_per_s"]}
    print(f"{card}: copy {rates['copy'] / 1e12:.2f} TB/s, bf16 matrix {rates['matrix'] / 1e12:.0f} TFLOP/s",
          flush=True)
    systems = ["cublas", "cublaslt", "splitk2", "splitk4"] + (["autotuned"] if args.autotune else [])
    meta = {**run_header(), "copy_bytes_per_s": rates["copy"], "matrix_flops_per_s": rates["matrix"],
            "settings": {"models": args.models, "rows": args.rows, "autotune": args.autotune,
                         "replays": args.replays}}
    rows: list[dict] = []
    for key in args.models:
        spec = MODELS[key]
        for product, (n, k, _) in spec["products"].items():
            weights = [ws[0] for ws in group_copies([n], k, DTYPE)]
            for m in args.rows:
                rows.append(measure(spec["name"], product, n, k, m, weights, args, rates))
                r = rows[-1]
                print(f"{r['model']} {product} {n}x{k} M={m}: roofline {r['roofline_us']:.1f} us ({r['bound']}); "
                      + ", ".join(f"{s} {r[f'{s}_us']:.1f} us ({r[f'{s}_pct_roofline']:.0f}%)" for s in systems
                                  if f"{s}_us" in r),
                      flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            del weights
            torch.cuda.empty_cache()
    totals = step_totals(rows, systems)
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "step_totals": totals}, indent=1))
    print(table(rows, totals, systems))
    return rows


if __name__ == "__main__":
    main()
