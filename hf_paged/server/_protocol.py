"""The request bodies of OpenAI's completions and chat completions APIs, as pydantic models.

Types and ranges are checked here, strictly (``"max_tokens": true`` or ``"n": "2"`` is a 400 naming the field, as a
JSON ``true`` is not a count; so is ``"top_p": 0``, with OpenAI's ranges); what the engine can serve is checked in
:mod:`hf_paged.server._sampling`.
Fields whose type is a union (``prompt``, ``stop``, a message's ``content``) are typed ``Any`` here and checked by
hand there, so that their errors name the field and say what it may be. Every string of a body was checked before
(:mod:`hf_paged.server._body`: valid Unicode, bounded nesting). Fields OpenAI defines that the engine does not serve
are declared so that a request setting them is refused rather than silently served otherwise; unknown fields are
ignored, as OpenAI does. ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos`` (generate exactly
``max_tokens``) are extensions (pass them in the client's ``extra_body``), as is ``response_format`` on
``/v1/completions``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's completions API
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's chat API
MAX_TOKENS_ASKED = 2**31  # beyond any model's context: larger counts are typos, refused before any arithmetic

class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Strict):
    """What both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1, lt=MAX_TOKENS_ASKED)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    ignore_eos: bool | None = False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists
    (each prompt gets ``n`` choices, numbered prompt by prompt). ``logprobs`` (0 to 5): each new token's
    log-probability and that many likeliest alternatives; ``echo``: the prompt is returned before the new text
    (and, with ``logprobs``, its tokens' log-probabilities, the first one null)."""

    prompt: Any
    max_tokens: int | None = Field(16, ge=0, lt=MAX_TOKENS_ASKED)  # (0: with echo only)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template. ``logprobs: true``
    returns the chosen tokens' log-probabilities, ``top_logprobs`` (0 to 20) that many likeliest alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=MAX_TOKENS_ASKED)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None


#: Every field name of the request models: what an error's ``param`` may name (pydantic's union tags may not).
FIELD_NAMES = frozenset(
    name for model in (StreamOptions, JsonSchemaFormat, ResponseFormat, CompletionRequest, ChatMessage,
                       ChatCompletionRequest)
    for field_name, info in model.model_fields.items() for name in (field_name, info.alias) if name)
