"""``hf-paged serve``: the OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``) on SmolLM2-135M-Instruct (chat with its own template), the tiny random-init model
(``--model tiny``) or ``--model PATH``, under uvicorn.

The port is bound before the model is loaded, so a port that is taken or invalid is one line on stderr (exit 2)
before anything says it is serving. SIGTERM or Ctrl-C stops accepting connections and lets in-flight requests finish
for ``--shutdown-timeout`` seconds; those still running then are answered 503 (streams end with an error event), and
the engine stops. If the engine's thread ever dies, the server stops at once and exits with status 1, for a
supervisor to restart it.

This module imports no torch: the model and the engine are imported and loaded once the command line is parsed and
the port is bound.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import socket
from dataclasses import fields

from hf_paged import envs
from hf_paged.cli._arguments import (exit_with, file_bytes, non_negative_float, non_negative_int, positive_float,
                                     positive_int, port)
from hf_paged.cli._generate import add_engine_arguments, utf8
from hf_paged.server import INSTALL_HINT, create_app
from hf_paged.server._limits import Limits

logger = logging.getLogger("hf_paged")
SHUTDOWN_BACKSTOP_S = 5.0  # uvicorn's own deadline, past ours: what is still open then is cut
#: The help of the flag of each ``Limits`` field (its type, default and metavar come from the field).
LIMIT_HELPS = {
    "max_body_bytes": "larger request bodies are refused with 413 before they are read",
    "read_timeout": "a client that sends no part of its request body for S seconds gets 408; one whose request line "
                    "and headers are not in S seconds after it connects is disconnected",
    "body_timeout": "a client whose request body is not complete S seconds after its headers gets 408, however often "
                    "it sends a part of it",
    "max_request_tokens": "a request whose copies would hold more tokens of context (prompt and new tokens, each copy "
                          "of n counted) is refused with 400",
    "max_response_bytes": "a request whose whole (not streamed) answer could take more bytes, as estimated from its "
                          "tokens and log-probabilities, is refused with 400",
    "stream_timeout": "a streaming client that takes no part of its stream for S seconds is disconnected and its "
                      "request aborted (one that leaves too many chunks unread is aborted sooner)",
}


def add_parser(subparsers) -> None:
    """Add the command to an argparse ``subparsers``."""
    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              description="Serve SmolLM2-135M-Instruct (fetched and converted once on first use), "
                                          "the tiny random-init Llama (--model tiny) or --model PATH behind an "
                                          "OpenAI-compatible HTTP API.")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: SmolLM2-135M-Instruct, hf-paged-tiny or the "
                        "checkpoint's folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics (default: "
                        f"${envs.API_KEY}, else none)")
    p.add_argument("--allowed-hosts", type=_host_list, metavar="H1,H2",
                   help="Host header names requests may be addressed to, or '*' for any (default: loopback names "
                        "when --host is loopback and there is no API key, against DNS rebinding; else any)")
    for f in fields(Limits):  # (an int is a count, N; a float is seconds, S)
        kind, metavar = (positive_int, "N") if isinstance(f.default, int) else (positive_float, "S")
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, metavar=metavar,
                       help=LIMIT_HELPS[f.name])
    p.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="let special-token text in chat messages (such as <|im_end|>) act as the control token it "
                        "names; by default it stays text in user, assistant and tool messages, so that no message "
                        "can end its turn or open one of another role")
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


def run(args: argparse.Namespace) -> int:
    """Serve until stopped: exit status 0, or 1 if the engine loop died."""
    if args.api_key is not None and not args.api_key.strip():  # (the environment's key: envs.api_key checks it)
        raise ValueError("--api-key is empty, which would serve with no key; set a non-empty key, or leave "
                         "--api-key out to serve without one")
    args.api_key = args.api_key or envs.api_key()
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return exit_with(args.prog, f"{INSTALL_HINT} ({exc})", status=1)
    sock = bind(args.host, args.port)  # before the model loads: a port in use is refused at once
    try:
        app = _app(args)
        # What exists now (the model, its compiled layers, the libraries) lives as long as this process: set aside
        # from the collector for good, so that no full collection walks it while requests wait (as frozen_heap does
        # for one call: hf_paged/_frozen_heap.py)
        gc.freeze()
        server = _server(args, app)
        host, bound_port = sock.getsockname()[:2]
        engine = app.state.engine_loop.engine
        # the pool's size and why (engine/_sizing.py): on a CPU its RAM is everyone's, so the line says what it took
        logger.warning("hf_paged: serving %r on http://%s:%d/v1 (%d KV blocks of %d tokens: %s)%s",
                       args.served_model_name, f"[{host}]" if ":" in host else host, bound_port,
                       engine.config.num_blocks, engine.config.block_size,
                       engine.stats()["sizing"].get("num_blocks", "given"),
                       "; API key required" if args.api_key else "")
        server.run(sockets=[sock])
    finally:
        sock.close()
    if (death := app.state.engine_loop.death) is not None:
        return exit_with(args.prog, f"the engine loop died ({death}); the server stopped", status=1)
    return 0


def _app(args: argparse.Namespace):
    """The app serving the model ``args`` name; sets ``args.served_model_name`` to what it serves under."""
    # (torch, transformers and the engine, and the optional starlette: imported once serve runs and has found them)
    from hf_paged.cli._generate_run import build_engine, load
    from hf_paged.server._access import LOOPBACK_HOSTS, is_loopback

    # by default, against DNS rebinding: loopback names where the host is loopback and no key is required
    allowed = args.allowed_hosts or (LOOPBACK_HOSTS if is_loopback(args.host) and not args.api_key else None)
    engine = build_engine(args, *load(args))
    args.served_model_name = args.served_model_name or args.model_name
    return create_app(engine, args.served_model_name, args.max_queued_requests, args.chat_template,
                      args.shutdown_timeout, api_key=args.api_key, allowed_hosts=allowed,
                      special_tokens_in_messages=args.allow_special_tokens_in_messages,
                      **{f.name: getattr(args, f.name) for f in fields(Limits)})  # (the limits' flags)


def _server(args: argparse.Namespace, app):
    """uvicorn's server for ``app``, which stops at once if the engine loop dies (``engine_loop.death`` then says
    why). Its shutdown answers the requests still live after ``--shutdown-timeout`` with 503: their handlers then
    finish, and uvicorn never has to cancel them (a 500 and a traceback)."""
    import uvicorn

    from hf_paged.server._http import with_header_timeout  # (uvicorn is optional: imported once it is there)

    server = uvicorn.Server(uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                           http=with_header_timeout(args.read_timeout),
                                           timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_BACKSTOP_S))
    engine_loop, shutdown = app.state.engine_loop, server.shutdown

    async def graceful_shutdown(sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(args.shutdown_timeout, engine_loop.begin_stop)
        try:
            await shutdown(sockets)
        finally:
            timer.cancel()

    def engine_died(reason: str) -> None:  # (the engine thread) nothing more can be answered: stop
        server.should_exit = True

    server.shutdown, engine_loop.on_death = graceful_shutdown, engine_died
    return server


def bind(host: str, port_number: int) -> socket.socket:
    """A socket bound to ``host:port_number`` (listening starts with the server); ``ValueError`` in one line if the
    address cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port_number, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on --host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = "pick another --port, or stop what uses it" if exc.errno == 98 else "check --host and --port"
        raise ValueError(f"cannot listen on {host}:{port_number}: {exc.strerror}; {hint}") from None
    sock.set_inheritable(True)
    return sock


def _host_list(text: str) -> tuple[str, ...]:
    if not (names := tuple(name.strip() for name in text.split(",") if name.strip())):
        raise argparse.ArgumentTypeError(f"expected comma-separated host names or '*', got {text!r}")
    return names


def _template_file(path: str) -> str:
    return utf8(file_bytes(path, "the chat template "), f"the chat template {path!r}")
