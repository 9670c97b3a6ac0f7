"""OpenAI's response bodies and server-sent-event chunks, built from the engine's outputs."""

from __future__ import annotations

import json

from hf_paged.server._events import Finished

#: The engine's finish reasons as OpenAI names them (EOS and stop strings are both "stop").
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(prompt_lengths: list[int], completion_tokens: int) -> dict:
    prompt = sum(prompt_lengths)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def completion(rid: str, created: int, model: str, done: list[Finished], prompt_lengths: list[int]) -> dict:
    choices = [{"index": f.index, "text": f.output.text or "", "logprobs": _completion_logprobs(f),
                "finish_reason": FINISH_REASONS.get(f.output.finish_reason)} for f in done]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_lengths, sum(len(f.output.token_ids) for f in done))}


def chat_completion(rid: str, created: int, model: str, done: list[Finished], prompt_lengths: list[int]) -> dict:
    choices = [{"index": f.index, "message": {"role": "assistant", "content": f.output.text or ""},
                "logprobs": _chat_logprobs(f), "finish_reason": FINISH_REASONS.get(f.output.finish_reason)}
               for f in done]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_lengths, sum(len(f.output.token_ids) for f in done))}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None,
                         "finish_reason": FINISH_REASONS.get(finish_reason) if finish_reason else None}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": FINISH_REASONS.get(finish_reason) if finish_reason else None}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, prompt_lengths: list[int], tokens: int) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_lengths, tokens)}


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _completion_logprobs(f: Finished) -> dict | None:
    if f.token_texts is None:
        return None
    offsets, at = [], 0
    for text in f.token_texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": f.token_texts, "token_logprobs": list(f.output.logprobs or []), "top_logprobs": None,
            "text_offset": offsets}


def _chat_logprobs(f: Finished) -> dict | None:
    if f.token_texts is None:
        return None
    content = [{"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
               for text, lp in zip(f.token_texts, f.output.logprobs or [])]
    return {"content": content, "refusal": None}
