"""The real-model tier's fixed chats and its oracle: SmolLM2-135M-Instruct with eager attention, one prompt at a
time, greedy (``model.generate``)."""

from __future__ import annotations

import bisect

import torch

NEW_TOKENS = 24

#: A long system prompt (about 190 tokens) shared by several chats: prefix caching, and a long prompt in a batch.
HANDBOOK = (
    "You are the help desk of Northwind Lighthouses, a small company on the coast of Brittany that restores old "
    "lighthouses and turns them into guest houses. The company was founded in 1987 by two sisters, Maud and Elise "
    "Kerbrat, and now employs forty people: carpenters, stone masons, glass makers and a team of six who run the "
    "guest houses. Each lighthouse keeps its original lamp, cleaned and rewired, and guests may climb to the lantern "
    "room at sunset. Breakfast is served from seven to ten; the kitchen uses bread from the village bakery and "
    "butter from a farm two kilometres away. Rooms cannot be booked for fewer than two nights in summer. Pets are "
    "welcome in the keeper's cottage but not in the tower. The nearest train station is in Quimper, forty minutes "
    "by car; the company runs a shuttle on Fridays and Sundays. Answer guests briefly and politely."
)

CHATS: dict[str, list[dict]] = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "hi": [{"role": "user", "content": "Hi!"}],
    "sea": [{"role": "user", "content": "Write one sentence about the sea."}],
    "handbook": [{"role": "system", "content": HANDBOOK},
                 {"role": "user", "content": "When is breakfast served?"}],
    "name": [{"role": "user", "content": "My name is Ana."},
             {"role": "assistant", "content": "Nice to meet you, Ana!"},
             {"role": "user", "content": "What is my name?"}],
    "sums": [{"role": "user", "content": "What is 12 times 12?"}],
}

#: Chats whose greedy answers hold multi-byte characters (accents, kana, emoji), some split over several tokens.
MULTI_BYTE_CHATS: dict[str, list[dict]] = {
    "emoji": [{"role": "user", "content": "Write a short birthday message with emoji 🎉🎂."}],
    "japanese": [{"role": "user", "content": "Say hello in Chinese and in Japanese."}],
    "accents": [{"role": "user", "content": "Copy this text exactly: Crème brûlée, 東京, 😀"}],
}

#: Questions to the help desk: the same system prompt, then different questions (prefix caching).
HANDBOOK_QUESTIONS = ["Can I bring my dog?", "How do I get there by train?", "Who founded the company?",
                      "Can I book one night in August?"]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template, as the server and the CLI make them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


class Answer:
    """A greedy answer: its tokens, its text, and where each token's text ends; the stop-string cases made of it."""

    def __init__(self, tokenizer, prompt: list[int], tokens: list[int]):
        self.prompt, self.tokens, self.text = prompt, tokens, decode(tokenizer, tokens)
        self.ends = [len(decode(tokenizer, tokens[: i + 1])) for i in range(len(tokens))]

    def token_text(self, k: int) -> str:
        return self.text[self.ends[k - 1] : self.ends[k]]

    def stops(self) -> dict[str, tuple[list[str], int]]:
        """Stop-string cases and where in the text each stops it (the first occurrence of any of its strings)."""
        k = next(k for k in range(2, len(self.tokens) - 2) if len(self.token_text(k).strip()) >= 3)
        mid = self.text[self.ends[k - 1] + 1 : self.ends[k] + 2]  # from the token's second character into the next
        j = next(j for j in range(k + 3, len(self.tokens) - 2) if self.token_text(j).strip())
        two = self.text[self.ends[j - 1] : self.ends[j + 1]]  # two whole tokens: begins at a token boundary
        assert self.text.find(mid) == self.ends[k - 1] + 1 and self.text.find(two) == self.ends[j - 1]
        return {
            "spans_two_tokens": ([two], self.ends[j - 1]),
            "begins_mid_token": ([mid], self.ends[k - 1] + 1),
            "several_at_once": (["no such text", two, mid], self.ends[k - 1] + 1),
        }


    def stop_token_count(self, stop_at: int) -> int:
        """How many tokens a stop string that begins at character ``stop_at`` leaves: up to and including the token
        in which it begins (OpenAI counts the tokens generated; they cover the text)."""
        return bisect.bisect_right(self.ends, stop_at) + 1


def assert_openai_stop(tokenizer, answer: Answer, text: str, token_ids: list[int], stop_at: int) -> None:
    """OpenAI: the text is cut before the stop string; the tokens are the answer's up to and including the token in
    which the stop string begins (so they cover the text, and none lies wholly after its start)."""
    assert text == answer.text[:stop_at]
    assert token_ids == answer.tokens[: answer.stop_token_count(stop_at)]
    assert decode(tokenizer, token_ids).startswith(text)


class EagerOracle:
    """Greedy new tokens of ``model.generate`` with eager attention, one prompt at a time (memoized)."""

    def __init__(self, model):
        self.model = model
        self._done: dict[tuple, list[int]] = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int = NEW_TOKENS, **kwargs) -> list[int]:
        key = (tuple(prompt), max_new_tokens, tuple(sorted(kwargs.items())))
        if key not in self._done:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, **kwargs)
            self._done[key] = out[0, len(prompt):].tolist()
        return self._done[key]
