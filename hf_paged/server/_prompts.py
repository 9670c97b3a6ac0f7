"""``PromptBuilder``: a request's prompt as token ids, and how many new tokens it may ask for.

Runs on the engine thread (the tokenizer is used by that thread only). A prompt that cannot be served, too long
for the model's position limit or for the whole KV cache, is refused here with a 400, before anything is queued.
"""

from __future__ import annotations

from jinja2 import TemplateError

from hf_paged.engine import Engine
from hf_paged.server._errors import bad_request

#: The chat template of a tokenizer that has none (the embedded default model's): one ``role: content`` line per
#: message, then ``assistant:`` for the model to continue.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class PromptBuilder:
    def __init__(self, engine: Engine, chat_template: str | None = None):
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.max_model_len
        self.cache_tokens = engine.pool.num_blocks * engine.pool.block_size
        has_own = self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None)
        self.chat_template = chat_template or (None if has_own else SIMPLE_CHAT_TEMPLATE)

    def token_ids(self, prompt, chat: bool) -> list[int]:
        """Token ids of a completion prompt (a string or ids) or of a chat (a list of messages), length-checked."""
        param = "messages" if chat else "prompt"
        if chat:
            ids = self._encode(self._render_chat(prompt), add_special_tokens=False)
        elif isinstance(prompt, str):
            ids = self._encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise bad_request(f"prompt token ids must be in [0, {self.vocab_size}), got {bad}", param)
        if not ids:
            raise bad_request("the prompt has no tokens", param)
        limit = min(self.max_model_len, self.cache_tokens + 1)
        if len(ids) >= limit:
            where = ("the model's position limit" if limit == self.max_model_len
                     else "the server's KV cache (--num-blocks x --block-size)")
            raise bad_request(f"the prompt has {len(ids)} tokens; {where} leaves room for at most {limit - 1} "
                              "prompt tokens and one new token: shorten it", param, "context_length_exceeded")
        return ids

    def max_new_tokens(self, prompt_len: int, asked: int | None, chat: bool) -> int:
        """``asked``, checked against what the prompt leaves; None: all it leaves."""
        room = min(self.max_model_len, self.cache_tokens) - prompt_len
        if asked is None:
            return room
        if asked > room:
            param = "max_completion_tokens" if chat else "max_tokens"
            raise bad_request(f"{param}={asked} with a prompt of {prompt_len} tokens passes the limit of "
                              f"{prompt_len + room} tokens (the model's and the KV cache's); ask for at most {room}",
                              param, "context_length_exceeded")
        return asked

    def _render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer, and this server has none; use /v1/completions with token ids")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as exc:
            raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("text prompts need a tokenizer, and this server has none; send token ids", "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
