"""From an OpenAI request body to what the engine runs: the prompts, and the settings of a ``GenerationConfig``.

Everything that can be checked without the tokenizer and is not a type or a range (those are
:mod:`hf_paged.server._protocol`'s) is checked here, with a 400 naming the field; the prompt's length (against the
model's position limit and the KV cache) is checked where it is tokenized (:mod:`hf_paged.server._prompts`). Sampling
fields left unset take the model's generation config, as ``model.generate`` does (so a model whose config says greedy
stays greedy); ``temperature: 0`` is greedy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import GenerationConfig

from hf_paged.server._body import json_type, parse
from hf_paged.server._errors import bad_request
from hf_paged.server._protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_PROMPTS = 1024
MAX_STOP_STRINGS = 16
#: Fields OpenAI defines that the engine does not serve, and what to do instead: a request setting one is refused
#: rather than served otherwise.
NOT_SERVED = {**dict.fromkeys(("tools", "functions"), "(tool calling) is not served; leave it out"),
              "suffix": "(insertion) is not served; leave it out", "logit_bias": "is not served; leave it out",
              **dict.fromkeys(("presence_penalty", "frequency_penalty"),
                              "is not served; use the repetition_penalty extension")}


@dataclass(frozen=True)
class Job:
    """One HTTP request as the engine thread takes it: ``prompts`` are strings or token-id lists (completions) or
    one list of chat messages (chat). ``max_tokens`` None means as many as the model's position limit leaves.
    ``settings``: the ``GenerationConfig`` keywords the request sets (sampling, ``json_schema``, logprobs).
    ``logprobs``: each new token's log-probability, with ``top_logprobs`` alternatives; ``echo``: the prompt comes
    back before the new text, with ``prompt_logprobs`` when ``logprobs`` is asked; ``max_tokens == 0`` (with
    ``echo`` only): the prompt alone (one token is computed and dropped)."""

    chat: bool
    prompts: list
    n: int
    max_tokens: int | None
    settings: dict = field(default_factory=dict)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    top_logprobs: int = 0
    echo: bool = False

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, num_return_sequences=self.n,
                                min_new_tokens=max_new_tokens if self.ignore_eos else None, **self.settings)


def make_job(body: bytes, model: type[CompletionRequest | ChatCompletionRequest], served: str) -> Job:
    """The job of a completions or a chat request (``body``, parsed as a ``model``) to the model ``served``; a 400
    naming the field for what cannot be served."""
    req = parse(body, model)
    if req.model != served:
        raise bad_request(f"model {req.model!r} is not served here; this server serves {served!r} (GET /v1/models)",
                          "model", "model_not_found")
    n = req.n or 1
    for name, instead in NOT_SERVED.items():
        if getattr(req, name, None):
            raise bad_request(f"{name} {instead}", name)
    if isinstance(req, ChatCompletionRequest):
        chat, echo, logprobs, top_logprobs = True, False, bool(req.logprobs), req.top_logprobs or 0
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        prompts = [[{"role": m.role, "content": _content(m.content, f"messages.{i}.content")}
                    for i, m in enumerate(req.messages)]]
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    else:
        chat, echo, logprobs, top_logprobs = False, bool(req.echo), req.logprobs is not None, req.logprobs or 0
        prompts = _completion_prompts(req.prompt)
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of is not served (the engine does not rank copies); use n", "best_of")
        if req.max_tokens == 0 and not echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt's log-probabilities alone)",
                              "max_tokens")
        max_tokens = req.max_tokens
    if len(prompts) * n > MAX_PROMPTS:
        raise bad_request(f"{len(prompts)} prompts x n={n} asks for {len(prompts) * n} choices; at most "
                          f"{MAX_PROMPTS} per request", "n" if n > 1 else "prompt")
    settings = sampling_settings(req)
    if (schema := json_schema(req)) is not None:
        settings["json_schema"] = schema
    if logprobs:  # (with echo, the prompt's too)
        settings.update(output_logprobs=True, top_logprobs=top_logprobs, prompt_logprobs=top_logprobs if echo else None)
    return Job(chat, prompts, n, max_tokens, settings, logprobs, bool(req.stream),
               bool(req.stream_options and req.stream_options.include_usage), bool(req.ignore_eos), top_logprobs, echo)


def json_schema(req: SamplingFields) -> str | None:
    """``response_format`` as the JSON schema the engine masks the new text to (None: free text)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema, the JSON schema of the answer",
                          "response_format.json_schema.schema")
    return json.dumps(fmt.json_schema.schema_, ensure_ascii=False)


def sampling_settings(req: SamplingFields) -> dict:
    """The ``GenerationConfig`` keywords of the sampling fields that were set."""
    out = {name: getattr(req, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty", "top_k")
           if getattr(req, name) is not None}
    if "top_k" in out:
        out["top_k"] = max(out["top_k"], 0)  # (-1: off, as 0)
    if out.get("temperature") == 0:  # greedy: the sampling settings go
        out = {k: v for k, v in out.items() if k == "repetition_penalty"} | {"do_sample": False}
    elif set(out) - {"repetition_penalty"}:
        out["do_sample"] = True
    if req.seed is not None:
        out["seed"] = req.seed
    if stop := _stop(req.stop):
        out["stop_strings"] = stop
    return out


def _completion_prompts(prompt) -> list:
    """``prompt`` as a list of prompts, each a non-empty string or a non-empty list of token ids."""
    def is_ids(p) -> bool:
        return isinstance(p, list) and all(type(t) is int for t in p)

    prompts = [prompt] if isinstance(prompt, str) or (prompt and is_ids(prompt)) else prompt
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) or is_ids(p) for p in prompts)):
        bad = prompt if not isinstance(prompt, list) or not prompt else next(
            (p for p in prompt if not (isinstance(p, (str, list)) or type(p) is int)), prompt)
        raise bad_request("prompt must be a string, an array of strings, an array of token ids or an array of "
                          f"token-id arrays; got {_kind(bad)}", "prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise bad_request("prompt is empty; give a non-empty string or token-id list",
                              "prompt" if len(prompts) == 1 else f"prompt.{i}")
    return prompts


def _content(content, param: str) -> str:
    """A chat message's content: a string, null, or text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request("only text content parts ({\"type\": \"text\", \"text\": \"...\"}) are served",
                                  f"{param}.{j}")
        return "".join(part["text"] for part in content)
    raise bad_request(f"content must be a string or an array of text parts, got {_kind(content)}", param)


def _stop(stop) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop must be a string or an array of strings, got {_kind(stop)}", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    return stops


def _kind(value) -> str:
    if isinstance(value, list):
        return "an empty array" if not value else "an array of mixed or other values"
    return json_type(value)
