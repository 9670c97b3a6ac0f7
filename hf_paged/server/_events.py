"""What the engine thread tells an HTTP handler about its request, through the handler's ``asyncio.Queue``: that it
was accepted, its new tokens, each choice's end, or a ``ServerError`` to answer with (nothing was queued, the server
is stopping, or the request was given up)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.engine._request_output import RequestOutput, TokenDelta
from hf_paged.server._errors import ServerError


@dataclass(frozen=True)
class Accepted:
    """The request is queued in the engine."""


@dataclass(frozen=True)
class Delta:
    """New tokens of choice ``index`` (streamed requests only; its :class:`Finished` says how it ended).
    ``token_texts`` (the text of each id the tokens and their alternatives name) is set when the request asked for
    logprobs."""

    index: int
    tokens: TokenDelta
    token_texts: dict[int, str] | None = None


@dataclass(frozen=True)
class Finished:
    """Choice ``index`` is done; ``output.finish_reason`` may be ``"error"`` (``output.error`` says why).
    ``token_texts`` (each id of the new tokens, of the prompt's with ``echo``, and of their alternatives, decoded
    alone) is set when the request asked for logprobs."""

    index: int
    output: RequestOutput
    token_texts: dict[int, str] | None = None


Event = Accepted | ServerError | Delta | Finished
