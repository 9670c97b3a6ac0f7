"""``hf-paged build-kernels`` and ``hf-paged bench kernels`` (decode, KV write and prefill rows)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_paged.cli._arguments import exit_with, output_path, positive_floats, positive_ints


def build_kernels(args: argparse.Namespace) -> int:
    """Build the CUDA kernels for the present GPU into the on-disk cache (later runs load them in a second)."""
    from hf_paged import kernels

    try:
        folder = kernels.prebuild(verbose=args.verbose)
    except kernels.KernelsUnavailable as exc:
        return exit_with(args.prog, f"cannot build the CUDA kernels here: {exc}", status=1)
    print(f"hf_paged: CUDA kernels ready in {folder}")
    return 0


def bench_kernels(args: argparse.Namespace) -> int:
    """Time decode and KV write against the copy bandwidth (and flash-attn when it imports), then prefill against
    flash-attn's and torch's varlen kernels; a table and a JSON file for each."""
    from hf_paged import kernels
    from hf_paged.bench import _kernels as decode_bench
    from hf_paged.bench import _prefill as prefill_bench
    from hf_paged.kernels._build import missing_requirement

    if (reason := missing_requirement() or kernels.unavailable_reason()) is not None:
        return exit_with(args.prog, f"needs hf_paged's CUDA kernels, which are unavailable here: {reason}", status=1)
    options = dict(head_dims=args.head_dims, sweep=not args.no_sweep, windows=args.windows or (),
                   softcaps=args.softcaps or ())
    if args.only in (None, "decode"):
        decode_bench.run(json_path=args.json, **options)
    if args.only in (None, "prefill"):
        json_path = Path(args.json)
        prefill_bench.run(json_path=json_path.with_name(f"{json_path.stem}_prefill{json_path.suffix}"), **options)
    return 0


def add_parsers(subparsers) -> None:
    """Add ``build-kernels`` and ``bench kernels`` to an argparse ``subparsers``."""
    p = subparsers.add_parser("build-kernels", help="build hf_paged's CUDA kernels for this GPU now")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=build_kernels, prog=p.prog)
    bench = subparsers.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="bench_target", required=True, metavar="TARGET")
    p = targets.add_parser("kernels", help="benchmark hf_paged's decode, KV-write and prefill kernels")
    p.add_argument("--json", type=output_path, default="bench_kernels.json",
                   help="where to write the decode results (JSON); prefill goes beside it as <name>_prefill.json")
    p.add_argument("--head-dims", type=positive_ints, default=(128, 64), metavar="DIMS",
                   help="comma-separated head dims")
    p.add_argument("--no-sweep", action="store_true", help="skip the split-length and tile-configuration sweeps")
    p.add_argument("--only", choices=["decode", "prefill"], help="run one half only (default: both)")
    p.add_argument("--windows", type=positive_ints, metavar="TOKENS",
                   help="add sliding-window rows, comma-separated window sizes (flash-attn with the same window)")
    p.add_argument("--softcaps", type=positive_floats, metavar="CAPS",
                   help="add logit-softcap rows, comma-separated caps such as 50 (each alone and with each window)")
    p.add_argument("--verbose", action="store_true", help="show a traceback for any error")
    p.set_defaults(func=bench_kernels, prog=p.prog)
