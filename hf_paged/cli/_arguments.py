"""How the ``hf-paged`` commands parse flags: one-line errors, defaults in ``--help``, and the ``type=`` checks the
commands share (``_generate.py`` holds those of the prompts and of the engine flags).

Every flag is checked while the command line is parsed, so a bad value is refused in one line naming the flag (exit
status 2, argparse's convention) before a model is loaded. Parsing imports no torch (only ``--device``'s check needs
it, and imports it when the flag names a device other than ``cpu``), so ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T", int, float)
#: The epilog of every command's ``--help``.
EXIT_STATUS = ("exit status: 0 done; 1 some requests failed, or the run could not complete (one line on stderr; "
               "--verbose adds the traceback); 2 bad input (a flag, file, checkpoint or prompt), named in one line "
               "on stderr; 130 interrupted; 141 the output was closed early (as '| head' does), quietly")
#: A checkpoint folder holding none of these has no tokenizer for ``AutoTokenizer`` to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` after a flag's help, except for switches and flags with no default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit status 2, and whose help ends
    with :data:`EXIT_STATUS` (the commands' parsers are made by this class too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", EXIT_STATUS)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook for every bad command line
        raise SystemExit(exit_with(self.prog, f"{message} (see '{self.prog} --help')"))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _checked(parse: Callable[[str], T], ok: Callable[[T], bool], rule: str) -> Callable[[str], T]:
    """A ``type=`` function: ``parse`` the text, then refuse a value that is not ``ok`` with ``must be {rule}``."""

    def check(text: str) -> T:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return check


def one_of(values: dict[str, object]) -> Callable[[str], object]:
    """A ``type=`` function taking one of the names in ``values`` to its value."""
    *names, last = values

    def check(text: str) -> object:
        if text not in values:
            raise argparse.ArgumentTypeError(f"expected {', '.join(names)} or {last}, got {text!r}")
        return values[text]

    return check


positive_int = _checked(_int, lambda v: v >= 1, "a positive integer")
non_negative_int = _checked(_int, lambda v: v >= 0, "an integer >= 0")
non_negative_float = _checked(_float, lambda v: v >= 0, ">= 0")
positive_float = _checked(_float, lambda v: v > 0, "> 0")
port = _checked(_int, lambda v: 1 <= v <= 65535, "a positive integer up to 65535 (a TCP port)")
probability = _checked(_float, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)")


def _positive_list(text: str, parse: Callable[[str], T], what: str) -> tuple[T, ...]:
    try:
        values = tuple(parse(part) for part in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        values = ()
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    return values


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. ``128,64``."""
    return _positive_list(text, int, "positive integers such as 128,64")


def positive_floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of positive finite numbers, e.g. ``50,30``."""
    return _positive_list(text, _float, "positive numbers such as 50,30")


def model(text: str) -> str:
    """``tiny``, ``smollm2`` or a local directory holding a transformers checkpoint: its ``config.json`` and tokenizer
    files (see :mod:`hf_paged.cli.default_model`)."""
    if text in ("tiny", "smollm2"):
        return text
    folder = Path(text)
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory {text!r}; give a local checkpoint directory")
    if not (folder / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json; give a transformers checkpoint directory "
                                         "(as save_pretrained writes it)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise argparse.ArgumentTypeError(f"{text!r} has no tokenizer files ({' or '.join(TOKENIZER_FILES[:2])}); "
                                         "save the model's tokenizer beside it (tokenizer.save_pretrained(DIR))")
    return text


def file_bytes(path: str, what: str = "") -> bytes:
    """The bytes of the file a flag names (``what`` it is, for the error); argparse's refusal of the flag where it
    cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {what}{path!r}: {exc.strerror or exc}") from None


def output_path(path: str) -> str:
    """A file path whose folder exists, so that a long run does not fail at the end when it writes."""
    if not Path(path).resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {path!r} does not exist; create it or give another path")
    return path


def flags_for_parameters(message: str, args: argparse.Namespace) -> str:
    """The library names its parameters (``block_size must be ...``); name the flags instead (``--block-size``)."""
    for dest in vars(args):
        if "_" in dest:
            message = re.sub(rf"\b{dest}\b", "--" + dest.replace("_", "-"), message)
    return message


def exit_with(prog: str, message: object, status: int = 2) -> int:
    """Print ``prog: error: message`` as one line on stderr (every run of whitespace, newlines included, made one
    space); returns ``status`` for the caller to exit with."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return status
