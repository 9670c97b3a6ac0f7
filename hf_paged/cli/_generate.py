"""``hf-paged generate``: continuous batching over many prompts, with a progress bar and a summary.

With no ``--model`` it runs SmolLM2-135M-Instruct (fetched and converted on first use; the tiny random-init model
where it cannot be had); ``--model tiny`` the tiny model, ``--model PATH`` a local checkpoint. Prompts come from
arguments, ``--prompts-file`` (one per line) or stdin (``-``); each is sent as one user message through the
tokenizer's chat template where it has one (``--no-chat-template``: as plain text).

Every answer to a prompt given is printed as plain text under its prompt (of the demo prompts, ``--show`` of them),
then a summary; ``--jsonl`` prints one JSON object per request instead (the summary goes to stderr). With one
prompt or ``--no-progress`` the answers are printed while they are generated (the first unfinished one token by
token); with the progress bar (several prompts), once every one is done.

This module holds the command's flags and their checks (those of the prompts, and of the engine flags, which ``serve``
shares) and imports no torch; the run itself is ``_generate_run.py``, which ``hf_paged.cli`` imports once the command
line is parsed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields

from hf_paged.cache._config import BACKENDS
from hf_paged.cli._arguments import (file_bytes, model, non_negative_float, non_negative_int, one_of, positive_int,
                                     probability)
from hf_paged.engine._config import EngineConfig

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
]
DESCRIPTION = ("Generate for many prompts with the continuous-batching engine, on SmolLM2-135M-Instruct (a real "
               "chat model, fetched and converted once on first use) unless --model says otherwise.")
MODEL_HELP = ("smollm2 (SmolLM2-135M-Instruct, fetched and cached on first use), tiny (a random-init Llama built in "
              "code: no download, its text is noise) or a local HF checkpoint directory (default: smollm2, or tiny "
              "with a note where it cannot be had)")
class BadText(ValueError, argparse.ArgumentTypeError):
    """Text that cannot be prompts (not UTF-8, binary, blank): a ``ValueError`` (bad input, exit status 2) where the
    run reads stdin, and argparse's one-line refusal of the flag where a flag's check raises it."""


def prompt(text: str) -> str:
    if text == "":
        raise BadText("a prompt is empty (''); give it some text or leave it out")
    return utf8(text, "a prompt")


def utf8(data: bytes | str, source: str) -> str:
    """``data`` as text if it is UTF-8; else :class:`BadText` naming ``source`` and the first byte that is not. Text is
    taken as the bytes it came from: bytes that are not UTF-8 reach Python as lone surrogates (the command line's
    arguments, and text streams under the C locale)."""
    try:
        return (data if isinstance(data, bytes) else data.encode("utf-8", "surrogateescape")).decode("utf-8")
    except UnicodeError as exc:
        bad = exc.object[exc.start]  # a byte, or in text a lone surrogate that stands for no byte
        what = f"byte {bad:#04x}" if isinstance(bad, int) else f"a lone surrogate U+{ord(bad):04X}"
        raise BadText(f"{source} is not UTF-8 text ({what} at offset {exc.start}); give UTF-8 text") from None


def prompts_file(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one prompt each."""
    return prompt_lines(file_bytes(path), repr(path))


def prompt_lines(data: bytes | str, source: str) -> list[str]:
    """One prompt per non-blank line of ``data`` (see :func:`utf8`); :class:`BadText` naming ``source`` if it is not
    UTF-8, binary or blank."""
    text = utf8(data, source)
    if "\0" in text:
        raise BadText(f"{source} holds NUL bytes (a binary file?); give text with one prompt per line")
    if not (lines := [line for line in text.splitlines() if line.strip()]):
        raise BadText(f"{source} holds no prompts (every line is blank)")
    return lines


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
    if unknown := [name for name in names if name not in BACKENDS]:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(map(repr, unknown))}; choose from "
                                         f"{', '.join(BACKENDS)} (comma-separated, in order of preference)")
    return names


#: How the command line reads each engine flag (the rest of a flag comes from its ``EngineConfig`` field).
FLAG_TYPES = {"num_blocks": non_negative_int, "block_size": positive_int, "max_batch_tokens": positive_int,
              "max_num_seqs": positive_int, "backend": backends, "memory_budget": probability,
              "kv_cache_dtype": one_of({"auto": None, "fp8": "fp8", "fp8_e4m3": "fp8_e4m3"}),
              "compile_layers": one_of({"auto": None, "on": True, "off": False}),
              "layer_kernels": one_of({"auto": None, "on": True, "off": False})}
#: ``--dtype``: auto (the checkpoint's) or a torch dtype's name.
DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_parser(subparsers, run: Callable[[argparse.Namespace], int]) -> None:
    """Add the command to an argparse ``subparsers``; ``run(args)`` runs it once parsed."""
    p = subparsers.add_parser("generate", help="generate for many prompts with the continuous-batching engine",
                              description=DESCRIPTION)
    p.add_argument("prompts", nargs="*", type=prompt, help="prompts ('-' reads one per line from stdin)")
    p.add_argument("--prompts-file", type=prompts_file, metavar="FILE", help="UTF-8 text, one prompt per line")
    p.add_argument("--num-prompts", type=positive_int, default=32, metavar="N",
                   help="with no prompts given: how many requests to make of the demo prompts")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send each prompt as plain text, not as a user message through the tokenizer's chat template "
                        "(used by default where the tokenizer has one)")
    p.add_argument("--show", type=non_negative_int, default=3, metavar="N",
                   help="with no prompts given: print this many of the demo's answers (every answer to prompts you "
                        "give is printed)")
    p.add_argument("--jsonl", action="store_true",
                   help="print one JSON object per request (prompt, text, prompt_tokens, generated_tokens, "
                        "finish_reason, and error where it failed) instead of plain text; the summary goes to stderr")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bar (shown for several prompts), and print the answers while they are "
                        "generated")
    p.add_argument("--verbose", action="store_true",
                   help="log the model, the engine's sizes and which attention backend serves each phase, add "
                        "steps and host time per step to the summary, and show a traceback for any error")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                   help="most tokens to generate per prompt")
    s.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens per prompt (EOS is masked, as by min_new_tokens)")
    s.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T", help="0 = greedy")
    s.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                   help="sample among the K likeliest tokens; 0 = off")
    s.add_argument("--top-p", type=probability, default=1.0, metavar="P",
                   help="sample among the likeliest tokens whose probabilities add up to P; 1 = off")
    s.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="seed of the sampler (and of the tiny model's random weights)")
    add_engine_arguments(p, helps={"num_blocks": "KV blocks in the pool; 0 = what these prompts need at full length, "
                                                 "at most what the memory budget holds"})
    p.set_defaults(func=run, prog=p.prog)


def add_engine_arguments(parser: argparse.ArgumentParser, max_num_seqs: bool = False,
                         helps: dict[str, str] | None = None) -> None:
    """The model and the engine's options, shared by the subcommands that run one: ``--model``, one flag per
    ``EngineConfig`` field that carries flag metadata (name, default, help and check from the field; ``helps``
    replaces a field's help), and where to run."""
    e = parser.add_argument_group("model and engine")
    e.add_argument("--model", type=model, metavar="MODEL", help=MODEL_HELP)
    for f in fields(EngineConfig):
        if "help" not in f.metadata or (f.name == "max_num_seqs" and not max_num_seqs):
            continue
        default = 0 if f.name == "num_blocks" and f.default is None else f.default
        e.add_argument("--" + f.name.replace("_", "-"), type=FLAG_TYPES[f.name], default=default,
                       metavar=f.metadata["metavar"], help=(helps or {}).get(f.name, f.metadata["help"]))
    e.add_argument("--device", type=device, help="where to run: cpu, cuda, cuda:N (default: cuda when available)")
    e.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="model dtype (auto: the checkpoint's; for smollm2 bfloat16 on a GPU and float32 on a CPU; "
                        "float32 for tiny)")


def engine_settings(args: argparse.Namespace) -> dict:
    """The ``Engine`` keywords of the engine flags on the command line (``--num-blocks 0``: None)."""
    settings = {name: getattr(args, name) for name in FLAG_TYPES if hasattr(args, name)}
    settings["num_blocks"] = settings["num_blocks"] or None
    return settings
