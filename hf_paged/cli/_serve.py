"""``hf-paged serve``: the OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``) on SmolLM2-135M-Instruct (chat with its own template), the tiny random-init model
(``--model tiny``) or ``--model PATH``, under uvicorn.

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish for ``--shutdown-timeout`` seconds,
then aborts the rest and stops the engine.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from hf_paged.cli._arguments import exit_with, model, non_negative_float, non_negative_int, positive_int
from hf_paged.cli._generate import MODEL_HELP, add_engine_arguments, engine_settings, load

logger = logging.getLogger("hf_paged")


def add_parser(subparsers, epilog: str | None = None) -> None:
    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              description="Serve SmolLM2-135M-Instruct (fetched and converted once on first use), "
                                          "the tiny random-init Llama (--model tiny) or --model PATH behind an "
                                          "OpenAI-compatible HTTP API.",
                              epilog=epilog)
    p.add_argument("--model", type=model, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: SmolLM2-135M-Instruct, hf-paged-tiny or the "
                        "checkpoint's folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    p.add_argument("--max-queued-requests", type=non_negative_int, default=256, metavar="N",
                   help="sequences that may wait beyond --max-num-seqs running ones; more are answered 429")
    p.add_argument("--chat-template", metavar="FILE", type=_template_file,
                   help="Jinja chat template to use instead of the tokenizer's")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="seed of the tiny model's random weights")
    p.add_argument("--verbose", action="store_true", help="log requests and the engine's setup")
    add_engine_arguments(p, max_num_seqs=True)
    p.set_defaults(func=run, prog=p.prog)


def run(args: argparse.Namespace) -> int:
    from hf_paged.server import INSTALL_HINT, create_app

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        return exit_with(args.prog, f"{INSTALL_HINT} ({exc})", status=1)
    from hf_paged.engine import Engine

    model, tokenizer = load(args)
    engine = Engine(model, tokenizer=tokenizer, **engine_settings(args))
    name = args.served_model_name or args.model_name
    app = create_app(engine, name, args.max_queued_requests, args.chat_template, args.shutdown_timeout)
    logger.warning("hf_paged: serving %r on http://%s:%d/v1 (%d KV blocks of %d tokens)", name, args.host, args.port,
                   engine.pool.num_blocks, engine.pool.block_size)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def _template_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path!r}: {exc}") from None
