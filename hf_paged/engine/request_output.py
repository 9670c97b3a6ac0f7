"""What the engine hands back: a finished request's ``RequestOutput`` and a streaming ``TokenDelta``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    """A finished sequence.

    ``token_ids`` holds the new tokens only (an EOS that stopped generation included, as ``model.generate`` keeps it;
    a stop string cut, with the token in which it begins and those after it). ``finish_reason``: ``"stop"`` (EOS or
    a stop string), ``"length"`` (``max_new_tokens``), ``"abort"`` or ``"error"`` (``error`` says why).
    ``logprobs[i]`` is the model's log-probability of ``token_ids[i]`` when asked for
    (``GenerationConfig(output_logprobs=True)``), else None. ``text`` is set when the engine has a tokenizer: the
    new tokens' text, special tokens skipped, cut before a stop string that stopped the request.
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
    """New tokens of one request since the last delta; ``finish_reason`` is set on the last delta of a request.

    With a tokenizer, ``text`` is the new text (possibly empty: an unfinished multi-byte character, or the tail a stop
    string may still cut, waits for a later delta, with its tokens); a request's deltas concatenate to its final
    ``RequestOutput``'s ``token_ids`` and ``text``. Without one, ``text`` is None.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
