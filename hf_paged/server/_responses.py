"""OpenAI's response bodies and server-sent-event chunks, built from the engine's outputs."""

from __future__ import annotations

import itertools
import json
import time
import uuid

from hf_paged.server._engine_loop import Delta, Finished, Submission


class Reply:
    """The bodies and chunks of one response of ``model`` to the request of ``sub`` (its prompts prepared), a chat
    request or a completions one; all carry the same fresh id and creation time."""

    def __init__(self, model: str, sub: Submission):
        self.model, self.chat, self.sub = model, sub.job.chat, sub
        self.offsets = [0] * (len(sub.job.prompts) * sub.job.n)  # characters of each choice's text streamed so far
        self.id, self.created = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

    def completion(self, done: list[Finished]) -> dict:
        """The whole answer, its choices in index order whatever the order of ``done``. Completions only: with
        ``echo``, the text of each prompt is put before its choices' text; with ``max_tokens: 0``, the prompt alone
        (the token computed to score it is dropped)."""
        n, echo, prompt_only, choices = self.sub.job.n, self.sub.prepared.echo_texts, self.sub.job.max_tokens == 0, []
        for f in sorted(done, key=lambda f: f.index):
            out = f.output
            if self.chat:
                choice = {"message": {"role": "assistant", "content": out.text or ""},
                          "logprobs": _chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs, f.token_texts)}
            else:
                head = echo[f.index // n] if echo is not None else ""
                choice = {"text": head + ("" if prompt_only else out.text or ""),
                          "logprobs": _completion_logprobs(f, echo is not None, prompt_only)}
            choices.append({"index": f.index, **choice, "finish_reason": out.finish_reason})
        generated = 0 if prompt_only else sum(len(f.output.token_ids) for f in done)
        return self._body(choices, usage=self._usage(generated))

    def chunk(self, index: int, text: str, finish_reason: str | None = None, delta: Delta | None = None,
              first: bool = False) -> str:
        """One streamed chunk of choice ``index``, as a server-sent event: its new ``text`` (a chat's ``delta`` is
        empty in the chunk with the ``finish_reason``, and names the role in the ``first``); ``delta``: the tokens
        whose log-probabilities go with ``text`` (when asked)."""
        logprobs, offset = None, self.offsets[index]
        self.offsets[index] += len(text)
        if delta is not None and delta.tokens.logprobs is not None:
            tokens = (delta.tokens.token_ids, delta.tokens.logprobs, delta.tokens.top_logprobs, delta.token_texts)
            logprobs = _chat_logprobs(*tokens) if self.chat else _legacy_logprobs(*tokens, offset)
        message = {} if finish_reason else {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, **({"delta": message} if self.chat else {"text": text}), "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return sse(self._body([choice], chunk=True))

    def usage_chunk(self, tokens: int) -> str:
        return sse(self._body([], chunk=True, usage=self._usage(tokens)))

    def _usage(self, completion_tokens: int) -> dict:
        prompt = sum(map(len, self.sub.prepared.prompts))
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def _body(self, choices: list, chunk: bool = False, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def json_bytes(body: dict) -> bytes:
    """A whole answer's ``body`` as compact UTF-8 JSON (what ``JSONResponse`` writes), each of its choices encoded
    by a call of its own: one ``json.dumps`` call holds the GIL until it returns, so an answer of tens of MB encoded
    at once would stall the event loop (``/health`` included) for as long, though it runs on a worker thread."""
    # (a key's quotes are bare only outside strings: the match is the key)
    before, after = _json({**body, "choices": []}).split('"choices":[]', 1)
    choices = b",".join(_json(choice).encode() for choice in body["choices"])
    return b"".join([before.encode(), b'"choices":[', choices, b"]", after.encode()])


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _completion_logprobs(f: Finished, echo: bool, prompt_only: bool) -> dict | None:
    out = f.output
    if f.token_texts is None:
        return None
    ids, logprobs, top = [], [], []
    if echo:
        ids += out.prompt_token_ids
        logprobs += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        top += out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
    if not prompt_only:
        ids += out.token_ids
        logprobs += out.logprobs or []
        top += out.top_logprobs or [[] for _ in out.token_ids]
    return _legacy_logprobs(ids, logprobs, top, f.token_texts, 0)


def _legacy_logprobs(ids: list[int], logprobs: list, top: list | None, texts: dict[int, str], offset: int) -> dict:
    """The completions API's ``logprobs``: tokens, their logprobs, the alternatives as ``{text: logprob}`` (the
    likeliest kept where two alternatives decode alike), and each token's character offset."""
    tokens = [texts.get(t, "") for t in ids]
    offsets = list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]  # the characters before each token
    alternatives = None if top is None else [None if row is None else _alternatives(row, texts) for row in top]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alternatives, "text_offset": offsets}


def _alternatives(row: list[tuple[int, float]], texts: dict[int, str]) -> dict[str, float]:
    alternatives: dict[str, float] = {}
    for t, lp in row:
        alternatives.setdefault(texts.get(t, ""), lp)
    return alternatives


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
