"""``hf-paged serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

``create_app(engine, model_name)`` gives the FastAPI application (FastAPI and uvicorn come with
``pip install -e ".[serve]"`` in the clone); ``hf-paged serve`` runs it under uvicorn. One thread owns the engine
(:mod:`~hf_paged.server._engine_loop`); the routes (:mod:`~hf_paged.server._app`) talk to it through queues.
"""

from __future__ import annotations

from hf_paged.server._limits import Limits

INSTALL_HINT = ("the server needs FastAPI and uvicorn: pip install -e '.[serve]' in the hf_paged clone (or pip install "
                "fastapi uvicorn)")


def create_app(engine, model_name: str, max_queued_requests: int = 256, chat_template: str | None = None,
               shutdown_timeout: float = 30.0, *, api_key: str | None = None,
               allowed_hosts: tuple[str, ...] | None = None, special_tokens_in_messages: bool = False,
               on_engine_death=None, **limits):
    """The OpenAI-compatible app serving ``engine`` as ``model_name``: at most ``engine.config.max_num_seqs +
    max_queued_requests`` sequences live at once (more get 429); ``chat_template`` (Jinja) overrides the
    tokenizer's; on shutdown, requests still live after ``shutdown_timeout`` seconds are aborted.

    ``api_key``: every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <key>``;
    ``allowed_hosts``: the ``Host`` names requests may be addressed to (None: any). Special-token text in the content
    of a user, assistant or tool message stays text unless ``special_tokens_in_messages`` (then it acts as the control
    token it names). ``on_engine_death(reason)``: called (from the engine thread) if the thread that runs the engine
    dies. The app's ``state.engine_loop`` is that thread's owner.

    ``limits`` are the fields of :class:`~hf_paged.server._limits.Limits` (their defaults are its):
    ``max_body_bytes``: larger bodies get 413; ``read_timeout``: a client that sends no part of its body for this long
    gets 408, as does one whose body is not complete ``body_timeout`` seconds after its headers. A request whose
    copies would hold more than ``max_request_tokens`` tokens of context, or whose whole answer would take more than
    about ``max_response_bytes``, gets 400; a stream whose client takes no chunk for ``stream_timeout`` seconds is
    given up and its request aborted."""
    try:
        from hf_paged.server._app import build_app
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return build_app(engine, model_name, max_queued_requests, chat_template, shutdown_timeout, api_key, allowed_hosts,
                     Limits(**limits), on_engine_death, special_tokens_in_messages)
