"""The request bodies of OpenAI's completions and chat completions APIs, as pydantic models.

Types are checked here (a wrong type is a 400 naming the field); ranges and what the engine can serve are checked
in :mod:`hf_paged.server._sampling`. Fields OpenAI defines that the engine does not serve are declared so that a
request setting them is refused rather than silently served otherwise; unknown fields are ignored, as OpenAI does.
``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos`` (generate exactly ``max_tokens``) are
extensions (pass them in the client's ``extra_body``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists
    (each prompt gets ``n`` choices, numbered prompt by prompt). ``logprobs`` is an integer: 0 returns the chosen
    tokens' log-probabilities (no alternatives); more is refused, the engine has no top-k alternatives."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template. ``logprobs: true``
    returns the chosen tokens' log-probabilities; ``top_logprobs`` above 0 is refused."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
