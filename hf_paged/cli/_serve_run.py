"""``hf-paged serve``'s run: bind the port, load the model, build the app and serve it under uvicorn until stopped.

Imported once the command line is parsed (``_serve.py`` holds the flags).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import socket

from hf_paged import envs
from hf_paged.cli._arguments import exit_with
from hf_paged.cli._generate import engine_settings
from hf_paged.cli._generate_run import load
from hf_paged.engine import Engine
from hf_paged.server import INSTALL_HINT, create_app
from hf_paged.server._access import LOOPBACK_HOSTS, is_loopback

logger = logging.getLogger("hf_paged")
SHUTDOWN_BACKSTOP_S = 5.0  # uvicorn's own deadline, past ours: what is still open then is cut


def run(args: argparse.Namespace) -> int:
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
    death = app.state.engine_loop.death
    if death is not None:
        return exit_with(args.prog, f"the engine loop died ({death}); the server stopped", status=1)
    return 0


def _app(args: argparse.Namespace):
    """The app serving the model ``args`` name; sets ``args.served_model_name`` and ``args.api_key`` (None: none) to
    what it serves under."""
    args.api_key = args.api_key or envs.api_key()
    allowed = args.allowed_hosts
    if allowed is None and is_loopback(args.host) and not args.api_key:
        allowed = LOOPBACK_HOSTS
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer=tokenizer, **engine_settings(args))
    args.served_model_name = args.served_model_name or args.model_name
    return create_app(engine, args.served_model_name, args.max_queued_requests, args.chat_template,
                      args.shutdown_timeout, api_key=args.api_key, allowed_hosts=allowed,
                      max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout)


def _server(args: argparse.Namespace, app):
    """uvicorn's server for ``app``, which stops at once if the engine loop dies (``engine_loop.death`` then says
    why). Its shutdown answers the requests still live after ``--shutdown-timeout`` with 503: their handlers then
    finish, and uvicorn never has to cancel them (a 500 and a traceback)."""
    import uvicorn

    from hf_paged.server._http import with_header_timeout  # (uvicorn is optional: imported once it is there)

    config = uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                            http=with_header_timeout(args.read_timeout),
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_BACKSTOP_S)
    server = uvicorn.Server(config)
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
