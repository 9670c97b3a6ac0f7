"""``hf-paged serve``: the OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``) on SmolLM2-135M-Instruct (chat with its own template), the tiny random-init model
(``--model tiny``) or ``--model PATH``, under uvicorn.

The port is bound before the model is loaded, so a port that is taken or invalid is one line on stderr (exit 2)
before anything says it is serving. SIGTERM or Ctrl-C stops accepting connections and lets in-flight requests finish
for ``--shutdown-timeout`` seconds; those still running then are answered 503 (streams end with an error event), and
the engine stops. If the engine's thread ever dies, the server stops at once and exits with status 1, for a
supervisor to restart it.

This module holds the command's flags and imports no torch; the run itself is ``_serve_run.py``, which
``hf_paged.cli`` imports once the command line is parsed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from hf_paged import envs
from hf_paged.cli._arguments import model, non_negative_float, non_negative_int, positive_float, positive_int, port
from hf_paged.cli._generate import MODEL_HELP, add_engine_arguments
from hf_paged.server._limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT_S


def add_parser(subparsers, run: Callable[[argparse.Namespace], int]) -> None:
    """Add the command to an argparse ``subparsers``; ``run(args)`` runs it once parsed."""
    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              description="Serve SmolLM2-135M-Instruct (fetched and converted once on first use), "
                                          "the tiny random-init Llama (--model tiny) or --model PATH behind an "
                                          "OpenAI-compatible HTTP API.")
    p.add_argument("--model", type=model, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: SmolLM2-135M-Instruct, hf-paged-tiny or the "
                        "checkpoint's folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on the /v1 routes (default: ${envs.API_KEY}, else "
                        "none)")
    p.add_argument("--allowed-hosts", type=_host_list, metavar="H1,H2",
                   help="Host header names requests may be addressed to, or '*' for any (default: loopback names "
                        "when --host is loopback and there is no API key, against DNS rebinding; else any)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="larger request bodies are refused with 413 before they are read")
    p.add_argument("--read-timeout", type=positive_float, default=DEFAULT_READ_TIMEOUT_S, metavar="S",
                   help="a client that sends no part of its request body for S seconds gets 408; one whose "
                        "request line and headers are not in S seconds after it connects is disconnected")
    p.add_argument("--max-queued-requests", type=non_negative_int, default=256, metavar="N",
                   help="sequences that may wait beyond --max-num-seqs running ones; more are answered 429")
    p.add_argument("--chat-template", metavar="FILE", type=_template_file,
                   help="Jinja chat template to use instead of the tokenizer's")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are answered 503")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="seed of the tiny model's random weights")
    p.add_argument("--verbose", action="store_true", help="log requests and the engine's setup")
    add_engine_arguments(p, max_num_seqs=True)
    p.set_defaults(func=run, prog=p.prog)


def _host_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated host names or '*', got {text!r}")
    return names


def _template_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path!r}: {exc}") from None
