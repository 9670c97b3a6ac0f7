"""``hf-paged serve --model smollm2`` in a subprocess, driven by the ``openai`` client: chat completions go through
the model's own chat template and give eager attention's greedy answers, prompt by prompt, with their token counts;
stop strings cut the text as OpenAI does, streamed or not; streamed multi-byte text is byte-identical to the
non-streamed text."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from real_chats import (  # noqa: E402
    CHATS,
    MULTI_BYTE_CHATS,
    NEW_TOKENS,
    Answer,
    chat_ids,
    decode,
)
from server_process import running_server  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(smollm2_dir):  # the fixture has fetched the model: the server finds it in the cache
    with running_server("--model", "smollm2", "--num-blocks", "256", "--max-num-seqs", "16") as (url, _):
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


def stream_chat(client, messages: list[dict], **kw) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_the_server_serves_smollm2(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_concurrent_chats_equal_eager_prompt_by_prompt(server, tokenizer, oracle):
    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0) as c:
            return await asyncio.gather(*[c.chat.completions.create(model=MODEL, messages=m, max_tokens=NEW_TOKENS,
                                                                    temperature=0) for m in CHATS.values()])

    for messages, answer in zip(CHATS.values(), asyncio.run(ask_all()), strict=True):
        want = oracle.greedy(chat_ids(tokenizer, messages))
        choice = answer.choices[0]
        assert choice.message.content == decode(tokenizer, want)
        assert choice.finish_reason == ("stop" if want[-1] == tokenizer.eos_token_id else "length")
        assert answer.usage.completion_tokens == len(want)
        assert answer.usage.prompt_tokens == len(chat_ids(tokenizer, messages))


def test_the_capital_of_france_is_paris(client):
    answer = client.chat.completions.create(model=MODEL, messages=CHATS["capital"], max_tokens=NEW_TOKENS,
                                            temperature=0)
    assert "Paris" in answer.choices[0].message.content


STOP_CASES = ["spans_two_tokens", "begins_mid_token", "several_at_once"]


def sea_answer(tokenizer, oracle) -> Answer:
    prompt = chat_ids(tokenizer, CHATS["sea"])
    return Answer(tokenizer, prompt, oracle.greedy(prompt))


@pytest.mark.parametrize("case", STOP_CASES)
def test_stop_strings_cut_the_text_and_count_the_tokens_as_openai_does(client, tokenizer, oracle, case):
    answer = sea_answer(tokenizer, oracle)
    stops, stop_at = answer.stops()[case]
    reply = client.chat.completions.create(model=MODEL, messages=CHATS["sea"], max_tokens=NEW_TOKENS, temperature=0,
                                           stop=stops)
    assert reply.choices[0].message.content == answer.text[:stop_at]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == answer.stop_token_count(stop_at)


@pytest.mark.parametrize("case", STOP_CASES)
def test_streamed_stop_strings_give_the_same_text(client, tokenizer, oracle, case):
    answer = sea_answer(tokenizer, oracle)
    stops, stop_at = answer.stops()[case]
    got = stream_chat(client, CHATS["sea"], max_tokens=NEW_TOKENS, temperature=0, stop=stops)
    assert got == (answer.text[:stop_at], "stop")


@pytest.mark.parametrize("name", sorted(MULTI_BYTE_CHATS))
def test_streamed_multi_byte_chat_is_byte_identical(client, name):
    ask = dict(max_tokens=32, temperature=0)
    reply = client.chat.completions.create(model=MODEL, messages=MULTI_BYTE_CHATS[name], **ask)
    text = reply.choices[0].message.content
    assert any(ord(ch) > 127 for ch in text), text
    streamed, reason = stream_chat(client, MULTI_BYTE_CHATS[name], **ask)
    assert streamed.encode("utf-8") == text.encode("utf-8")
    assert reason == reply.choices[0].finish_reason
