"""From an OpenAI request body to what the engine runs: the prompts, and the settings of a ``GenerationConfig``.

Everything that can be checked without the tokenizer is checked here, with a 400 naming the field; the prompt's
length (against the model's position limit and the KV cache) is checked where it is tokenized, on the engine
thread (:mod:`hf_paged.server._engine_loop`). Sampling fields left unset take the model's generation config, as
``model.generate`` does (so a model whose config says greedy stays greedy); ``temperature: 0`` is greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import GenerationConfig

from hf_paged.server._errors import bad_request
from hf_paged.server._protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_N = 128
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Job:
    """One HTTP request as the engine thread takes it: ``prompts`` are strings or token-id lists (completions) or
    one list of chat messages (chat). ``max_tokens`` None means as many as the model's position limit leaves."""

    chat: bool
    prompts: list
    n: int
    max_tokens: int | None
    settings: dict = field(default_factory=dict)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, num_return_sequences=self.n,
                                output_logprobs=self.logprobs, min_new_tokens=max_new_tokens if self.ignore_eos else None,
                                **self.settings)


def completion_job(req: CompletionRequest) -> Job:
    prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not _is_ids(req.prompt) else [req.prompt]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("prompt is empty; give a non-empty string or token-id list", "prompt")
    if req.echo:
        raise bad_request("echo is not served; send echo: false and prepend the prompt yourself", "echo")
    if req.suffix:
        raise bad_request("suffix (insertion) is not served; leave it out", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not served (the engine does not rank copies); use n", "best_of")
    if req.logprobs is not None and req.logprobs != 0:
        raise bad_request("logprobs > 0 asks for alternative tokens, which the engine does not return; send "
                          "logprobs: 0 for the chosen tokens' log-probabilities", "logprobs")
    return _job(req, chat=False, prompts=prompts, max_tokens=req.max_tokens, logprobs=req.logprobs is not None)


def chat_job(req: ChatCompletionRequest) -> Job:
    for name in ("tools", "functions"):
        if getattr(req, name):
            raise bad_request(f"{name} (tool calling) is not served; leave it out", name)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("response_format other than text is not served", "response_format")
    if req.top_logprobs:
        raise bad_request("top_logprobs > 0 asks for alternative tokens, which the engine does not return; send "
                          "logprobs: true alone for the chosen tokens' log-probabilities", "top_logprobs")
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise bad_request("only text content parts are served", f"messages[{i}].content")
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        messages.append({"role": m.role, "content": content})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return _job(req, chat=True, prompts=[messages], max_tokens=max_tokens, logprobs=req.logprobs, param=param)


def _job(req: SamplingFields, chat: bool, prompts: list, max_tokens: int | None, logprobs: bool,
         param: str = "max_tokens") -> Job:
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.stream and logprobs:
        raise bad_request("logprobs with stream: true are not served yet (the engine's streamed deltas carry no "
                          "log-probabilities); ask without stream", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name} is not served; use the repetition_penalty extension", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not served; leave it out", "logit_bias")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    settings = sampling_settings(req)
    if req.n > 1 and settings.get("do_sample") is False:
        raise bad_request("n > 1 with temperature 0 would return n identical copies; sample (temperature > 0) or "
                          "ask for n = 1", "n")
    return Job(chat, prompts, req.n, max_tokens, settings, logprobs, req.stream, include_usage, req.ignore_eos)


def sampling_settings(req: SamplingFields) -> dict:
    """The ``GenerationConfig`` keywords of the sampling fields that were set (checked against OpenAI's ranges)."""
    out: dict = {}
    t = req.temperature
    if t is not None:
        _finite("temperature", t, lambda v: 0 <= v <= 2, "in [0, 2]")
    for name, ok, rule in (("top_p", lambda v: 0 < v <= 1, "in (0, 1]"), ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
                           ("repetition_penalty", lambda v: v > 0, "> 0")):
        value = getattr(req, name)
        if value is not None:
            out[name] = _finite(name, value, ok, rule)
    if req.top_k is not None:
        if req.top_k < -1:
            raise bad_request(f"top_k must be >= 0 (0 or -1: off), got {req.top_k}", "top_k")
        out["top_k"] = max(req.top_k, 0)
    if t == 0:
        out = {k: v for k, v in out.items() if k == "repetition_penalty"}
        out["do_sample"] = False
    elif t is not None or set(out) - {"repetition_penalty"}:
        out["do_sample"] = True
        if t is not None:
            out["temperature"] = float(t)
    if req.seed is not None:
        if not 0 <= req.seed < 2**63:
            raise bad_request(f"seed must be in [0, 2**63), got {req.seed}", "seed")
        out["seed"] = req.seed
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise bad_request(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    if stop:
        out["stop_strings"] = stop
    return out


def _finite(name: str, value: float, ok, rule: str) -> float:
    if not (math.isfinite(value) and ok(value)):
        raise bad_request(f"{name} must be {rule}, got {value}", name)
    return float(value)


def _is_ids(prompt: list) -> bool:
    return all(isinstance(t, int) for t in prompt)
