"""``PromptBuilder``: a request's prompts as token ids, and how many new tokens each may ask for.

It runs on a tokenizer thread of its own (``EngineLoop._prepare``), off the engine's thread and off the event loop,
with its own copy of the tokenizer, so that a long prompt delays neither the running requests' steps nor the other
clients' requests. Before any work, a text prompt whose characters could not fit the model even at the most
characters a token covers is refused at once; after tokenizing, a prompt that cannot be served (too long for the
model's position limit or for the whole KV cache), or that asks for more than the server's ``Limits``, is
refused with a 400, before anything is queued.

A chat's messages are the client's text: special-token text in the content of a user, assistant or tool message
(``<|im_end|>`` typed by a user) stays text, so that no message can close its turn and open one of another role; the
chat template's own markers are the only control tokens. The template is rendered once more with each such content
between two markers no client can guess, which tells the template's text from the messages'; the template's text is
split at its special tokens, as the tokenizer splits any text, and every piece between them, content included, is
tokenized with special-token text kept as text. ``special_tokens_in_messages=True`` tokenizes the rendered chat
whole instead, so that special-token text in a message acts as the control token it names (for clients that mean it).
"""

from __future__ import annotations

import copy
import logging
import re
import secrets
from dataclasses import dataclass, replace

from jinja2 import TemplateError
from transformers import GenerationConfig

from hf_paged.engine import Engine
from hf_paged.engine import _validation as validation
from hf_paged.server._errors import bad_request
from hf_paged.server._limits import Limits
from hf_paged.server._sampling import Job

logger = logging.getLogger("hf_paged")

#: The chat template of a tokenizer that has none (the embedded default model's): one ``role: content`` line per
#: message, then ``assistant:`` for the model to continue.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
#: Slack on the characters-per-token bound (a normalizer may drop characters before the tokens are made).
CHARS_SLACK = 4
#: The roles whose content is kept as text (system and developer messages are the deployer's instructions).
TEXT_ROLES = ("user", "assistant", "tool")
_NONCE = secrets.token_hex(8)
OPEN, CLOSE = f"\ue000{_NONCE}\ue001", f"\ue002{_NONCE}\ue003"  # around a message's content in a marked rendering
_MARKS = re.compile(f"{OPEN}|{CLOSE}")


@dataclass(frozen=True)
class Prepared:
    """A job's prompts as the engine takes them; ``echo_texts``: with ``echo``, each prompt's text."""

    prompts: list[list[int]]
    configs: list[GenerationConfig]
    echo_texts: list[str] | None = None


class PromptBuilder:
    def __init__(self, engine: Engine, chat_template: str | None = None, limits: Limits = Limits(),
                 special_tokens_in_messages: bool = False):
        try:  # (a copy for the tokenizer thread alone: the engine's thread decodes with the original)
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception as exc:  # a tokenizer that cannot be copied: shared, as before (reads only)
            logger.warning("hf_paged: the tokenizer cannot be copied (%s); the server's threads share it", exc)
            self.tokenizer = engine.tokenizer
        self.limits, self.special_tokens_in_messages = limits, special_tokens_in_messages
        self.vocab_size = engine.vocab_size
        self.samples_by_default = bool(getattr(engine.generation_config, "do_sample", False))
        # the most tokens, prompt and new ones, that one sequence may hold
        self.max_total = min(engine.max_model_len, engine.config.num_blocks * engine.config.block_size)
        has_own = getattr(self.tokenizer, "chat_template", None)
        self.chat_template = chat_template or (None if has_own else SIMPLE_CHAT_TEMPLATE)
        longest = max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer is not None else 1
        self.limit = engine.max_prompt_tokens + 1
        self.where = ("the model's position limit" if self.limit == engine.max_model_len
                      else "the server's KV cache (--num-blocks x --block-size)")
        self.max_chars = self.limit * max(longest, 1) * CHARS_SLACK
        added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True) if self.tokenizer is not None else []
        # (a capturing group: re.split keeps the special tokens it splits at)
        self.specials = re.compile(f"({'|'.join(map(re.escape, added))})") if added else None

    def prepare(self, job: Job) -> Prepared:
        """The token ids and generation config of each prompt of ``job``; a 400 for one that cannot be served."""
        prompts = [self.token_ids(p, job.chat) for p in job.prompts]
        new_tokens = [self.max_new_tokens(len(ids), job.max_tokens, job.chat) for ids in prompts]
        self.limits.check(job, [len(ids) for ids in prompts], new_tokens)
        if job.n > 1:  # copies must sample: a sampling field asks to, or the model's default does
            if not job.settings.get("do_sample", self.samples_by_default):
                raise bad_request(f"n={job.n} would return {job.n} identical copies: the request decodes greedily "
                                  "(temperature 0, or no sampling field set on a model whose generation config is "
                                  "greedy); set temperature > 0, or ask for n = 1", "n")
            job = replace(job, settings={**job.settings, "do_sample": True})
        return Prepared(prompts, [job.generation_config(n) for n in new_tokens], [
            p if isinstance(p, str) else self.decode(ids) for p, ids in zip(job.prompts, prompts)]
            if job.echo else None)

    def token_ids(self, prompt, chat: bool) -> list[int]:
        """Token ids of a completion prompt (a string or ids) or of a chat (a list of messages), length-checked."""
        param, limit = "messages" if chat else "prompt", self.limit
        if chat or isinstance(prompt, str):
            if (chars := sum(len(m["content"]) for m in prompt) if chat else len(prompt)) > self.max_chars:
                raise bad_request(f"the prompt has {chars} characters: more than {self.where} can hold ("
                                  f"{limit - 1} tokens); shorten it", param, "context_length_exceeded")
            ids = self._chat_ids(prompt) if chat else self._encode(prompt, add_special_tokens=True)
        else:
            ids = prompt
        if len(ids) >= limit:
            raise bad_request(f"the prompt has {len(ids)} tokens; {self.where} leaves room for at most "
                              f"{limit - 1} prompt tokens and one new token: shorten it", param,
                              "context_length_exceeded")
        try:  # (the engine's own check: no ids, or ids outside the vocabulary)
            return validation.prompt_token_ids(ids, self.vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc), param) from None

    def max_new_tokens(self, prompt_len: int, asked: int | None, chat: bool) -> int:
        """``asked``, checked against what the prompt leaves; None: all it leaves; 0 (echo alone): one."""
        room = self.max_total - prompt_len
        if asked is None:
            return room
        if asked > room:
            param = "max_completion_tokens" if chat else "max_tokens"
            raise bad_request(f"{param}={asked} with a prompt of {prompt_len} tokens passes the limit of "
                              f"{prompt_len + room} tokens (the model's and the KV cache's); ask for at most {room}",
                              param, "context_length_exceeded")
        return max(asked, 1)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer, and this server has none; use /v1/completions with token ids")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as exc:
            raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from None

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        """The token ids of a chat: special-token text in its messages' content kept as text (the module says how)."""
        text = self._render_chat(messages)
        guarded = [] if self.special_tokens_in_messages or self.specials is None else [
            i for i, m in enumerate(messages) if m["role"] in TEXT_ROLES and self.specials.search(m["content"])]
        if not guarded:  # (nothing to keep: the rendered chat as it is)
            return self._encode(text, add_special_tokens=False)
        marked = self._render_chat([{**m, "content": _marked(m["content"])} if i in guarded else m
                                    for i, m in enumerate(messages)])
        if _MARKS.sub("", marked) != text:
            param = f"messages.{guarded[0]}.content"
            raise bad_request(f"{param} holds special-token text, which this server keeps as text, but the chat "
                              "template changes message content, so its text cannot be told from the template's; "
                              "remove the special-token text (or serve with --allow-special-tokens-in-messages)", param)
        ids, pending = [], []  # pending: the text since the template's last special token
        for i, part in enumerate(_MARKS.split(marked)):  # even parts: the template's text; odd: a message's content
            pieces = [part] if i % 2 else self.specials.split(part)
            for j, piece in enumerate(pieces):
                if j % 2:  # one of the template's special tokens
                    ids += self._text_ids("".join(pending)) + [self.tokenizer.convert_tokens_to_ids(piece)]
                    pending = []
                else:
                    pending.append(piece)
        return ids + self._text_ids("".join(pending))

    def _text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)) if text else []

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("text prompts need a tokenizer, and this server has none; send token ids", "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _marked(content: str) -> str:
    """``content`` with its text between :data:`OPEN` and :data:`CLOSE`, whitespace at either end outside (where a
    template that trims content leaves it out)."""
    start, end = len(content) - len(content.lstrip()), len(content.rstrip())
    return content[:start] + OPEN + content[start:end] + CLOSE + content[end:]
