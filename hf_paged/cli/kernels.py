"""``hf-paged build-kernels`` and ``hf-paged bench kernels`` (decode, KV write and prefill rows).

The entry point in :mod:`hf_paged.cli` calls :func:`add_parsers`; ``python -m hf_paged.cli.kernels build|bench``
runs the same commands on its own.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def build_kernels(args: argparse.Namespace) -> int:
    """Build the CUDA kernels for the present GPU into the on-disk cache (later runs load them in a second)."""
    from hf_paged import kernels

    try:
        folder = kernels.prebuild(verbose=getattr(args, "verbose", False))
    except kernels.KernelsUnavailable as exc:
        print(f"hf_paged: cannot build the CUDA kernels here: {exc}")
        return 1
    print(f"hf_paged: CUDA kernels ready in {folder}")
    return 0


def bench_kernels(args: argparse.Namespace) -> int:
    """Time decode and KV write against the copy bandwidth (and flash-attn when it imports), then prefill against
    flash-attn's and torch's varlen kernels; a table and a JSON file for each."""
    from hf_paged.bench import kernels as decode_bench
    from hf_paged.bench import prefill as prefill_bench

    head_dims = tuple(int(h) for h in args.head_dims.split(","))
    if args.only in (None, "decode"):
        decode_bench.run(json_path=args.json, head_dims=head_dims, sweep=not args.no_sweep)
    if args.only in (None, "prefill"):
        json_path = Path(args.json)
        prefill_bench.run(json_path=json_path.with_name(f"{json_path.stem}_prefill{json_path.suffix}"),
                          head_dims=head_dims, sweep=not args.no_sweep)
    return 0


def _add_bench_kernels(subparsers, name: str = "kernels") -> None:
    p = subparsers.add_parser(name, help="benchmark hf_paged's decode, KV-write and prefill kernels")
    p.add_argument("--json", default="bench_kernels.json",
                   help="where to write the decode results (JSON); prefill goes beside it as <name>_prefill.json")
    p.add_argument("--head-dims", default="128,64", help="comma-separated head dims (default 128,64)")
    p.add_argument("--no-sweep", action="store_true", help="skip the split-length and tile-configuration sweeps")
    p.add_argument("--only", choices=["decode", "prefill"], default=None, help="run one half only")
    p.set_defaults(func=bench_kernels)


def add_parsers(subparsers, bench_subparsers=None) -> None:
    """Add ``build-kernels`` and ``bench kernels`` to an argparse ``subparsers``.

    If the caller already has a ``bench`` command, pass its subparsers as ``bench_subparsers`` and only ``kernels``
    is added under it.
    """
    p = subparsers.add_parser("build-kernels", help="build hf_paged's CUDA kernels for this GPU now")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=build_kernels)
    if bench_subparsers is None:
        bench = subparsers.add_parser("bench", help="benchmarks")
        bench_subparsers = bench.add_subparsers(dest="bench_target", required=True)
    _add_bench_kernels(bench_subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged.cli.kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the CUDA kernels for this GPU now")
    build.add_argument("--verbose", action="store_true", help="show the compiler's output")
    build.set_defaults(func=build_kernels)
    _add_bench_kernels(sub, "bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
