"""The ``hf-paged`` command line: ``hf-paged generate`` (the main job) and the kernels engineer's subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging


def build_parser() -> argparse.ArgumentParser:
    from hf_paged.cli.generate import add_parser as add_generate

    parser = argparse.ArgumentParser(prog="hf-paged", description="vLLM-style paged attention for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    try:
        kernels = importlib.import_module("hf_paged.cli.kernels")
    except ImportError:
        kernels = None
    if kernels is not None and hasattr(kernels, "add_parsers"):
        kernels.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(message)s")
    return int(args.func(args) or 0)
