"""How the ``hf-paged`` commands parse flags: one-line errors, defaults in ``--help``, and the ``type=`` checks.

Every flag is checked here, while the command line is parsed, so a bad value is refused in one line naming the
flag (exit status 2, argparse's convention) before a model is loaded. Parsing imports no torch (only ``--device``'s
check needs it, and imports it when the flag names a device other than ``cpu``), so ``--help`` and a bad flag answer
at once.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hf_paged.cache._config import BACKENDS

T = TypeVar("T", int, float)
#: A checkpoint folder holding none of these has no tokenizer for ``AutoTokenizer`` to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` after a flag's help, except for switches and flags with no default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook for every bad command line
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")


def one_line(text: object) -> str:
    """``text`` with every run of whitespace, newlines included, made one space."""
    return " ".join(str(text).split())


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


def device(text: str) -> str:
    """A torch device that exists here: ``cpu``, ``cuda``, ``cuda:N``, ``mps``..."""
    if text == "cpu":  # always there: no need to import torch to parse it
        return text
    import torch  # (heavy: imported only where another device is named)

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise argparse.ArgumentTypeError(f"{text!r} is not available ({why}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    backend = getattr(torch, dev.type, None) if dev.type != "cuda" else None
    if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} is not available here; use --device cpu")
    return text


def backends(text: str) -> tuple[str, ...]:
    """Attention backends to allow, comma-separated, in the order to try them."""
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(map(repr, unknown))}; choose from "
                                         f"{', '.join(BACKENDS)} (comma-separated, in order of preference)")
    return names


def kv_cache_dtype(text: str) -> str | None:
    """What the KV pool stores: ``auto`` or ``fp8`` (``fp8_e4m3``)."""
    if text not in ("auto", "fp8", "fp8_e4m3"):
        raise argparse.ArgumentTypeError(f"expected auto, fp8 or fp8_e4m3, got {text!r}")
    return None if text == "auto" else text


def compile_layers(text: str) -> bool | str | None:
    """``Engine(compile_layers=...)``: ``auto`` (None), ``on``, ``off`` or ``background``."""
    choices = {"auto": None, "on": True, "off": False, "background": "background"}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected auto, on, off or background, got {text!r}")
    return choices[text]


def prompt(text: str) -> str:
    if text == "":
        raise argparse.ArgumentTypeError("a prompt is empty (''); give it some text or leave it out")
    try:
        return utf8_text(text, "a prompt")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def utf8_text(text: str, source: str) -> str:
    """``text`` if UTF-8 can encode it; else ``ValueError`` naming ``source``. Bytes that are not UTF-8 reach Python
    as lone surrogates (the command line's arguments, and text streams under the C locale)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        what = f"byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else f"a lone surrogate U+{char:04X}"
        raise ValueError(f"{source} is not UTF-8 text ({what} at character {exc.start}); give UTF-8 text") from None
    return text


def prompts_file(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one prompt each."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        return prompt_lines(utf8_bytes(data, repr(path)), repr(path))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def prompt_lines(text: str, source: str) -> list[str]:
    """One prompt per non-blank line of ``text``; ``ValueError`` naming ``source`` if it is binary or blank."""
    if "\0" in text:
        raise ValueError(f"{source} holds NUL bytes (a binary file?); give text with one prompt per line")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{source} holds no prompts (every line is blank)")
    return lines


def checkpoint_dir(path: str) -> str:
    """A local directory holding a transformers checkpoint: its ``config.json`` and tokenizer files."""
    if not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"no such directory {path!r}; give a local checkpoint directory")
    if not (Path(path) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path!r} has no config.json; give a transformers checkpoint directory "
                                         "(as save_pretrained writes it)")
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise argparse.ArgumentTypeError(f"{path!r} has no tokenizer files ({' or '.join(TOKENIZER_FILES[:2])}); "
                                         "save the model's tokenizer beside it (tokenizer.save_pretrained(DIR))")
    return path


def model(text: str) -> str:
    """``tiny``, ``smollm2`` or a local checkpoint directory (see :mod:`hf_paged.cli.default_model`)."""
    if text in ("tiny", "smollm2"):
        return text
    return checkpoint_dir(text)


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


def utf8_bytes(data: bytes, source: str) -> str:
    """``data`` decoded as UTF-8; else ``ValueError`` naming ``source`` and the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); give "
                         "UTF-8 text, one prompt per line") from None


def exit_with(prog: str, message: object, status: int = 2) -> int:
    """Print ``prog: error: message`` as one line on stderr; returns ``status`` for the caller to exit with."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return status
