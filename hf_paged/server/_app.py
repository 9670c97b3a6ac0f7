"""``build_app``: the FastAPI application, its routes and its error handlers.

A request passes the door first (``_access``): the access check (``--api-key``, the ``Host`` allow-list) and the body
limits (size, read timeout, body deadline); then its body is parsed and checked off the event loop (``_body``,
``_sampling``). Handlers then hand jobs to the :class:`~hf_paged.server._engine_loop.EngineLoop` and wait on their own
``asyncio.Queue``; they never touch the engine. A whole answer is built and serialized on a worker thread, never on the
event loop, and one choice at a time (``_responses.json_bytes``). A client that goes away (caught when a write fails or,
while waiting, by polling the connection), or that takes no part of its stream for ``--stream-timeout`` seconds, has its
request aborted, which frees its KV blocks at the next step. Every error, unknown routes and methods included, is
answered in OpenAI's error shape. The routes read their bodies themselves and declare no parameter FastAPI would
validate (the model's id in a path is any string), so FastAPI's own validation never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hf_paged.server._access import Door, answer
from hf_paged.server._engine_loop import Delta, EngineLoop, Event, Finished
from hf_paged.server._errors import ServerError
from hf_paged.server._limits import Limits
from hf_paged.server._prompts import PromptBuilder
from hf_paged.server._protocol import ChatCompletionRequest, CompletionRequest
from hf_paged.server._responses import Reply, json_bytes, sse
from hf_paged.server._sampling import make_job

logger = logging.getLogger("hf_paged")
DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there
ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


def build_app(engine, model_name: str, max_queued_requests: int, chat_template: str | None, shutdown_timeout: float,
              api_key: str | None, allowed_hosts: tuple[str, ...] | None, limits: Limits, on_engine_death,
              special_tokens_in_messages: bool) -> FastAPI:
    """:func:`hf_paged.server.create_app`'s app; its lifespan starts the engine loop and stops it (aborting what is
    still live) when the server shuts down. ``api_key``, ``allowed_hosts``: ``_access.Door``'s; ``limits``: what
    one client may make the server do (``_limits.Limits``, which ``Door`` and the prompt builder apply);
    ``special_tokens_in_messages``: ``_prompts.PromptBuilder``'s."""
    prompts = PromptBuilder(engine, chat_template, limits, special_tokens_in_messages)
    engine_loop = EngineLoop(engine, engine.config.max_num_seqs + max_queued_requests, prompts, on_engine_death)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.thread.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop, shutdown_timeout)

    app = FastAPI(title="hf-paged", lifespan=lifespan, exception_handlers=dict.fromkeys(
        (ServerError, StarletteHTTPException, ClientDisconnect, Exception), _error))
    app.state.engine_loop = engine_loop
    app.add_middleware(Door, limits=limits, api_key=api_key, allowed_hosts=allowed_hosts)
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "hf-paged",
            "max_model_len": engine.max_model_len}

    @app.get("/health")
    async def health():
        if not engine_loop.thread.is_alive():
            why = f": {engine_loop.death}" if engine_loop.death else ""
            raise ServerError(503, f"the engine loop is not running{why}", code="engine_dead")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ServerError(404, f"the model {model_id!r} does not exist here; this server serves {model_name!r}",
                              "model", "model_not_found")
        return card

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(await asyncio.to_thread(engine_loop.metrics.render),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(engine_loop, request, CompletionRequest, model_name, limits.stream_timeout)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(engine_loop, request, ChatCompletionRequest, model_name, limits.stream_timeout)

    return app


async def _serve(engine_loop: EngineLoop, request: Request, model, served: str, stream_timeout: float):
    """Answer ``request``: its body is parsed as a ``model``, checked and made a job in a worker thread
    (a large body never blocks the event loop)."""
    job = await asyncio.to_thread(make_job, await request.body(), model, served)
    sub = await engine_loop.submit(job)
    reply = Reply(served, sub)
    try:
        await _next(sub.events, request)  # (Accepted)
        if job.stream:  # the stream owns the request from here
            return EventStream(_stream(engine_loop, request, reply), stream_timeout)
        # (the engine loop posts deltas to streams only: each event here is a choice's Finished)
        finished: list[Finished] = [await _next(sub.events, request) for _ in range(len(job.prompts) * job.n)]
    except BaseException:  # refused, failed, client gone, or the handler was cancelled (server shutdown)
        engine_loop.cancel(sub)
        raise
    return await asyncio.to_thread(lambda: Response(json_bytes(reply.completion(finished)),
                                                    media_type="application/json"))


class EventStream(StreamingResponse):
    """Server-sent events whose client must take each chunk within ``timeout`` seconds. A client that stops reading
    pauses the stream (its chunks wait in its handler's queue, as many as ``_engine_loop`` lets them); one that takes
    no chunk for ``timeout`` seconds is given up: the stream's generator is closed, which aborts its request, and the
    connection is closed with the response unfinished."""

    def __init__(self, chunks: AsyncIterator[str], timeout: float):
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.timeout = timeout

    async def stream_response(self, send) -> None:
        try:  # (only a send times out here: the chunks' own waits for events time out inside _next)
            await super().stream_response(lambda message: asyncio.wait_for(send(message), self.timeout))
        except asyncio.TimeoutError:
            logger.warning("hf_paged: a client took no part of its stream for %g s (--stream-timeout); its request "
                           "was aborted", self.timeout)
        finally:
            await self.body_iterator.aclose()


async def _stream(engine_loop: EngineLoop, request: Request, reply: Reply) -> AsyncIterator[str]:
    """The server-sent events of ``reply``'s request: its chunks, then ``[DONE]``; the request's error (refused, or
    failed in the engine) as an event of its own before ``[DONE]``. A request left unfinished is aborted."""
    sub = reply.sub
    job, num_choices, finished, tokens = sub.job, len(sub.job.prompts) * sub.job.n, 0, 0
    try:
        for index in range(num_choices):
            if job.chat or job.echo:
                yield reply.chunk(index, "" if job.chat else sub.prepared.echo_texts[index // job.n], first=True)
        while finished < num_choices:
            event = await _next(sub.events, request)
            if isinstance(event, Delta):
                text = event.tokens.text or ""
                if text or (event.tokens.token_ids and event.tokens.logprobs is not None):
                    yield reply.chunk(event.index, text, delta=event)
            else:
                finished, tokens = finished + 1, tokens + len(event.output.token_ids)
                yield reply.chunk(event.index, "", event.output.finish_reason)
        if job.include_usage:
            yield reply.usage_chunk(tokens)
    except ServerError as error:
        yield sse(error.body())
    except ClientDisconnect:
        return
    finally:
        if finished < num_choices:  # (a job whose choices all finished is gone from the engine already)
            engine_loop.cancel(sub)
    yield sse("[DONE]")


async def _next(events: asyncio.Queue, request: Request) -> Event:
    """The next event of this request; raises the request's error if it was refused or the engine failed on it,
    ``ClientDisconnect`` if the client left meanwhile."""
    while True:
        try:
            event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ClientDisconnect from None
            continue
        if isinstance(event, ServerError):
            raise event
        if isinstance(event, Finished) and event.output.finish_reason == "error":
            raise ServerError(500, f"the engine failed on this request: {event.output.error or 'no reason given'}",
                              code="engine_error")
        return event


async def _error(request: Request, exc: Exception):
    """Every error's answer, in OpenAI's shape: a ``ServerError`` as it is; starlette's (an unknown route or method
    named, with the routes there are), a client gone while its request was read or answered (499), and anything
    unexpected (logged, 500) made one."""
    headers = None
    if isinstance(exc, StarletteHTTPException):
        message, code = {
            404: (f"no route {request.method} {request.url.path}; this server serves {ROUTES}", "not_found"),
            405: (f"{request.url.path} does not take {request.method}; this server serves {ROUTES}",
                  "method_not_allowed")}.get(exc.status_code, (str(exc.detail), None))
        exc, headers = ServerError(exc.status_code, message, code=code), getattr(exc, "headers", None)
    elif isinstance(exc, ClientDisconnect):
        exc = ServerError(499, "client closed the request")
    elif not isinstance(exc, ServerError):
        logger.exception("hf_paged: unexpected error serving %s", request.url.path)
        exc = ServerError(500, f"unexpected {type(exc).__name__}: {exc}", code="internal_error")
    return answer(exc, headers)
