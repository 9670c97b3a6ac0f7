"""What the engine hands back: a finished request's ``RequestOutput`` and a streaming ``TokenDelta``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hf_paged.engine._detokenizer import Detokenizer
from hf_paged.engine._sequence import Sequence

logger = logging.getLogger("hf_paged")


@dataclass(frozen=True)
class RequestOutput:
    """A finished sequence.

    ``token_ids`` holds the new tokens only (an EOS that stopped generation included, as ``model.generate`` keeps it;
    after a stop string, those up to and including the token in which it begins: the tokens that cover ``text``,
    which ``usage`` counts). ``finish_reason``: ``"stop"`` (EOS or
    a stop string), ``"length"`` (``max_new_tokens``), ``"abort"`` or ``"error"`` (``error`` says why).
    ``logprobs[i]`` is the model's log-probability of ``token_ids[i]`` when asked for
    (``GenerationConfig(output_logprobs=True)``), else None. ``text`` is set when the engine has a tokenizer: the
    new tokens' text, special tokens skipped, cut before a stop string that stopped the request.
    ``top_logprobs[i]``: the ``(token id, logprob)`` pairs of the likeliest tokens at ``token_ids[i]``'s place,
    most likely first, when asked for (``GenerationConfig(top_logprobs=k)``). ``prompt_logprobs[p]``: the
    log-probability of prompt token ``p`` given those before it (None for the first), and
    ``prompt_top_logprobs[p]`` its alternatives, when asked for (``GenerationConfig(prompt_logprobs=k)``).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: list[float] | None = None
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since the last delta; ``finish_reason`` is set on the last delta of a request.

    With a tokenizer, ``text`` is the new text (possibly empty: an unfinished multi-byte character, or the tail a stop
    string may still cut, waits for a later delta, with its tokens); a request's deltas concatenate to its final
    ``RequestOutput``'s ``token_ids`` and ``text``. Without one, ``text`` is None. ``logprobs`` and
    ``top_logprobs`` are those of ``token_ids`` when the request asked for them.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def output_of(seq: Sequence, detokenizer: Detokenizer | None) -> RequestOutput:
    """A finished sequence's output: its tokens (and text, with a detokenizer) cut before a stop string that
    stopped it."""
    tokens, text, reason, error, logprobs, top = _unread(seq, detokenizer, True, 0, 0)
    prompt = prompt_top = None
    if seq.params.prompt_logprobs is not None:
        prompt = [None] + [lp for lp, _ in seq.prompt_logprobs]
        prompt_top = [None] + [alternatives for _, alternatives in seq.prompt_logprobs]
    return RequestOutput(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], tokens, reason, error, logprobs,
                         text, top, prompt, prompt_top)


def delta_of(seq: Sequence, detokenizer: Detokenizer | None, final: bool) -> TokenDelta | None:
    """The tokens (and text) of ``seq`` not streamed yet that may be shown now (None: none), changing nothing but
    the detokenizer's cache; ``final``: the last delta, with the finish reason. With a detokenizer, tokens and
    text come out together (``detokenizer.py`` says what waits)."""
    new, text, reason, _, logprobs, top = _unread(seq, detokenizer, final, seq.num_streamed, seq.text_state.sent)
    if not new and not text and not final:
        return None
    return TokenDelta(seq.request_id, new, reason if final else None, text, logprobs, top)


def _unread(seq: Sequence, detokenizer: Detokenizer | None, final: bool, streamed: int, sent: int) -> tuple:
    """``(tokens, text, finish reason, error, logprobs, top logprobs)`` of ``seq`` from token ``streamed`` and
    character ``sent`` on, as far as they may be shown (all of them when ``final``: cut before a stop string). A
    tokenizer that cannot decode the ids fails the request, its tokens kept and its text None."""
    tokens, text, reason, error = seq.output_token_ids, None, seq.finish_reason, seq.error
    kept = len(tokens)
    if detokenizer is not None:
        try:
            kept, shown = detokenizer.shown(seq, final)
            text = seq.text_state.text[sent:shown]
        except Exception as exc:
            logger.warning("hf_paged: could not decode the tokens of %s: %s", seq.request_id, exc)
            kept, text, reason = len(tokens), None, "error"
            error = error or f"the tokenizer could not decode the generated tokens: {type(exc).__name__}: {exc}"
    new, params = tokens[streamed:kept], seq.params
    logprobs = seq.logprobs[streamed : streamed + len(new)] if params.logprobs else None
    top = seq.top_logprobs[streamed : streamed + len(new)] if params.logprobs and params.top_logprobs else None
    return new, text, reason, error, logprobs, top
