"""What the engine hands back: a finished request's ``RequestOutput`` and a streaming ``TokenDelta``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    """A finished sequence.

    ``token_ids`` holds the new tokens only (an EOS that stopped generation included, as ``model.generate`` keeps it).
    ``finish_reason``: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_new_tokens``), ``"abort"`` or
    ``"error"`` (``error`` says why). ``logprobs[i]`` is the model's log-probability of ``token_ids[i]`` when asked
    for (``GenerationConfig(output_logprobs=True)``), else empty. ``text`` is set when the engine has a tokenizer.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: list[float] | None = None
    text: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since the last delta; ``finish_reason`` is set on the last delta of a request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
