"""The greedy sampler's argmax over a vocabulary: torch's one reduction against two stages (chunk maxima, then the
chunk of the largest).

At batch 1 a decode step's argmax over Llama-3's 128,256 logits took 27.6 us of device time on an H100 (the decode
profile of ``benchmarks/e2e/throughput.py``): one row is one reduction of a block or few, which leaves the card's
other SMs idle. ``two_stage_<C>`` cuts each row into ``C`` chunks (``C`` divides the vocabulary), takes each chunk's
maximum and its index (``max(-1)``: one reduction per chunk, ``rows * C`` of them in parallel), then the first
chunk holding the largest maximum (``argmax`` over ``C`` values) and that chunk's index: the first maximum of the row,
as ``argmax`` gives it, ties included (a chunk's index is its first maximum, and the first chunk with the largest
maximum holds the row's first).

Every variant's indices are checked against ``torch.argmax`` first, on logits with planted ties. Times are of a
CUDA graph rotating over enough logit sets to overflow L2 (``hf_paged.bench.time_calls``); on a CPU (``--smoke``)
the host clock's. The table goes to stdout, ``--json`` writes the rows with the card, the versions and the date.

    python -m benchmarks.kernels.argmax [--rows 1,8,64,256] [--vocab 128256] [--chunks 32,64,128,256]
        [--dtypes bfloat16,float32] [--json F] [--smoke]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_paged.bench import input_sets, run_header, time_calls


def two_stage(chunks: int):
    """Row-wise first argmax in two reductions over ``chunks`` chunks of each row."""
    def argmax(x: torch.Tensor) -> torch.Tensor:
        rows, vocab = x.shape
        width = vocab // chunks
        maxima, within = x.view(rows, chunks, width).max(-1)  # [rows, chunks] each
        chunk = maxima.argmax(-1, keepdim=True)
        return (within.gather(-1, chunk) + chunk * width).squeeze(-1)
    return argmax


def logits(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random logits whose row maxima repeat: each row's largest value planted at two or three places."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    for r in range(rows):
        places = torch.randint(0, vocab, (2 + r % 2,), generator=g)
        x[r, places] = 8.0
    return x.to(dtype=dtype, device=device)


def measure(rows: int, vocab: int, dtype: torch.dtype, chunks: list[int], device: str, smoke: bool) -> dict:
    sets = 2 if smoke else input_sets(rows * vocab * dtype.itemsize)
    xs = [logits(rows, vocab, dtype, device, seed) for seed in range(sets)]
    variants = {"torch": lambda x: x.argmax(-1), **{f"two_stage_{c}": two_stage(c) for c in chunks if vocab % c == 0}}
    row = {"rows": rows, "vocab": vocab, "dtype": str(dtype).removeprefix("torch.")}
    for name, fn in variants.items():
        for x in xs:
            if not torch.equal(fn(x), x.argmax(-1)):
                raise AssertionError(f"{name} at {rows} x {vocab} {dtype}: not torch.argmax's indices")
        timing = time_calls([lambda x=x: fn(x) for x in xs], budget_s=0.05 if smoke else 0.4, device=device)
        row[f"{name}_us"] = round(timing.median_s * 1e6, 2)
    return row


def table(rows: list[dict]) -> str:
    names = [k.removesuffix("_us") for k in rows[0] if k.endswith("_us")]
    lines = ["| rows x vocab | dtype | " + " | ".join(f"{n} us" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    lines += [f"| {r['rows']} x {r['vocab']} | {r['dtype']} | " + " | ".join(
        f"{r[f'{n}_us']:.1f}" if f"{n}_us" in r else "-" for n in names) + " |" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,256", help="comma-separated row counts")
    parser.add_argument("--vocab", type=int, default=128256, help="logits per row (Llama-3's vocabulary)")
    parser.add_argument("--chunks", default="32,64,128,256", help="comma-separated chunk counts (divisors of --vocab)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated logit dtypes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="a small vocabulary on the CPU, to check the code runs")
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r]
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    args.dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
    if args.smoke:
        args.rows, args.vocab = [r for r in args.rows if r <= 8] or [1], 4096
    if not [c for c in args.chunks if c > 0 and args.vocab % c == 0]:
        parser.error(f"no chunk count in {args.chunks} divides the vocabulary ({args.vocab})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    rows = [measure(r, args.vocab, dtype, args.chunks, device, args.smoke) for dtype in args.dtypes for r in args.rows]
    if args.json:
        args.json.write_text(json.dumps({"meta": run_header(), "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
