"""The ``hf-paged`` command line (also ``python -m hf_paged``): ``generate`` (the main job), ``serve`` (an
OpenAI-compatible server), ``build-kernels`` and ``bench kernels``.

Errors: a bad flag, file, checkpoint or request is reported in one line on stderr with exit status 2 (argparse's
convention); anything else unexpected is one line and status 1, with the traceback under ``--verbose``. Output
closed early (``| head``) ends quietly with status 141, as SIGPIPE ends other tools.

Parsing imports no torch or transformers (the flags come from torch-free config modules; each command's run imports
what it needs), so ``--help`` and every bad flag answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback

from hf_paged._version import __version__
from hf_paged.cli import _generate as generate
from hf_paged.cli import _kernels as kernels
from hf_paged.cli import _serve as serve
from hf_paged.cli._arguments import Parser, exit_with, flags_for_parameters


def build_parser(prog: str = "hf-paged") -> Parser:
    parser = Parser(prog=prog, description="vLLM-style paged attention for transformers")
    parser.add_argument("--version", action="version", version=f"hf-paged {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub, run=_run_generate)
    serve.add_parser(sub)
    kernels.add_parsers(sub)
    return parser


# generate's run imports torch, transformers and the engine, so it is imported only once the command line is parsed:
# --help and a bad flag answer at once. (A heavy import made lazy; no cycle: the run imports only modules below this.)
def _run_generate(args: argparse.Namespace) -> int:
    from hf_paged.cli._generate_run import run

    return run(args)


def main(argv: list[str] | None = None, prog: str = "hf-paged") -> int:
    """Run one command; returns its exit status (see :data:`hf_paged.cli._arguments.EXIT_STATUS`)."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad flag, already reported in one line
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    logger = logging.getLogger("hf_paged")
    level = logger.level
    logger.setLevel(logging.DEBUG if verbose else logging.NOTSET)
    try:
        return int(args.func(args) or 0)
    except (ValueError, NotImplementedError) as exc:  # what the library refuses to serve: bad input
        if verbose:
            traceback.print_exc()
        return exit_with(args.prog, flags_for_parameters(str(exc), args) if isinstance(exc, ValueError) else exc)
    except KeyboardInterrupt:
        return exit_with(args.prog, "interrupted", status=130)
    except BrokenPipeError:  # the reader of the output left (| head): end quietly, as SIGPIPE ends other tools
        # stdout pointed at the null device, so that the flush at exit does not fail (and print) again
        with contextlib.suppress(OSError, ValueError):  # (no file descriptor behind it: nothing to flush)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 141
    except Exception as exc:
        torch = sys.modules.get("torch")  # (a command that never imported torch cannot run out of device memory)
        if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
            if verbose:
                traceback.print_exc()
            return exit_with(args.prog, f"out of device memory ({str(exc).splitlines()[0]}); lower --num-blocks or "
                                        "--max-batch-tokens, or run on a larger device", status=1)
        if verbose:
            raise
        return exit_with(args.prog, f"unexpected {type(exc).__name__}: {exc} (run again with --verbose for the "
                                    "traceback, and please report it)", status=1)
    finally:
        logger.setLevel(level)
