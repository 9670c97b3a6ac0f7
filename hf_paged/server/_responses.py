"""OpenAI's response bodies and server-sent-event chunks, built from the engine's outputs."""

from __future__ import annotations

import json

from hf_paged.server._events import Delta, Finished

#: The engine's finish reasons as OpenAI names them (EOS and stop strings are both "stop").
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(prompt_lengths: list[int], completion_tokens: int) -> dict:
    prompt = sum(prompt_lengths)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def completion(rid: str, created: int, model: str, done: list[Finished], prompt_lengths: list[int],
               echo: list[str] | None = None, echo_texts: dict[int, str] | None = None,
               prompt_only: bool = False) -> dict:
    """``echo``: the text of each prompt, put before its choices' text; ``prompt_only`` (``max_tokens: 0``): the
    prompt alone (the token computed to score it is dropped)."""
    n = len(done) // max(len(prompt_lengths), 1)
    choices = []
    for f in done:
        head = echo[f.index // n] if echo is not None else ""
        text = head + ("" if prompt_only else f.output.text or "")
        choices.append({"index": f.index, "text": text,
                        "logprobs": _completion_logprobs(f, echo is not None, echo_texts, prompt_only),
                        "finish_reason": FINISH_REASONS.get(f.output.finish_reason)})
    generated = 0 if prompt_only else sum(len(f.output.token_ids) for f in done)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_lengths, generated)}


def chat_completion(rid: str, created: int, model: str, done: list[Finished], prompt_lengths: list[int]) -> dict:
    choices = [{"index": f.index, "message": {"role": "assistant", "content": f.output.text or ""},
                "logprobs": _chat_logprobs(f.output.token_ids, f.output.logprobs, f.output.top_logprobs,
                                           f.token_texts),
                "finish_reason": FINISH_REASONS.get(f.output.finish_reason)}
               for f in done]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_lengths, sum(len(f.output.token_ids) for f in done))}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     delta: Delta | None = None, offset: int = 0) -> dict:
    """``delta``: the tokens whose log-probabilities go with ``text`` (when asked); ``offset``: where the text
    starts in the choice's whole text."""
    logprobs = None
    if delta is not None and delta.logprobs is not None:
        logprobs = _legacy_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs, delta.token_texts, offset)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": FINISH_REASONS.get(finish_reason) if finish_reason else None}]}


def chat_chunk(rid: str, created: int, model: str, index: int, content: dict, finish_reason: str | None,
               delta: Delta | None = None) -> dict:
    logprobs = None
    if delta is not None and delta.logprobs is not None:
        logprobs = _chat_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs, delta.token_texts)
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": content, "logprobs": logprobs,
                         "finish_reason": FINISH_REASONS.get(finish_reason) if finish_reason else None}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, prompt_lengths: list[int], tokens: int) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_lengths, tokens)}


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _completion_logprobs(f: Finished, echo: bool, echo_texts: dict[int, str] | None, prompt_only: bool) -> dict | None:
    out = f.output
    if f.token_texts is None:
        return None
    ids, logprobs, top = [], [], []
    texts = dict(f.token_texts)
    if echo:
        ids += out.prompt_token_ids
        logprobs += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        top += out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
        texts.update(echo_texts or {})
    if not prompt_only:
        ids += out.token_ids
        logprobs += out.logprobs or []
        top += out.top_logprobs or [[] for _ in out.token_ids]
    return _legacy_logprobs(ids, logprobs, top, texts, 0)


def _legacy_logprobs(ids: list[int], logprobs: list, top: list | None, texts: dict[int, str], offset: int) -> dict:
    """The completions API's ``logprobs``: tokens, their logprobs, the alternatives as ``{text: logprob}`` (the
    likeliest kept where two alternatives decode alike), and each token's character offset."""
    tokens = [texts.get(t, "") for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    alternatives = None
    if top is not None:
        alternatives = []
        for row in top:
            if row is None:
                alternatives.append(None)
                continue
            alt: dict[str, float] = {}
            for t, lp in row:
                alt.setdefault(texts.get(t, ""), lp)
            alternatives.append(alt)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alternatives, "text_offset": offsets}


def _chat_logprobs(ids: list[int], logprobs: list[float] | None, top: list | None,
                   texts: dict[int, str] | None) -> dict | None:
    if texts is None or logprobs is None:
        return None
    top = top or [[] for _ in ids]
    content = [{**_chat_token(texts.get(t, ""), lp),
                "top_logprobs": [_chat_token(texts.get(a, ""), alp) for a, alp in row]}
               for t, lp, row in zip(ids, logprobs, top)]
    return {"content": content, "refusal": None}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
