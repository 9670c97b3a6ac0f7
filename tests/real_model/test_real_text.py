"""Real text through the engine: stop strings on a real answer (spanning two tokens, beginning mid-token, several at
once) follow OpenAI's semantics in the returned text, ``token_ids`` and the stream alike; streamed multi-byte text
(accents, kana, emoji split over tokens) is byte-identical to the finished text; prefix caching on a shared system
prompt gives the tokens a cache without it gives, with the hits in ``stats()``."""

from __future__ import annotations

import os

import pytest
from real_chats import (
    CHATS,
    HANDBOOK,
    HANDBOOK_QUESTIONS,
    MULTI_BYTE_CHATS,
    NEW_TOKENS,
    Answer,
    assert_openai_stop,
    chat_ids,
    decode,
)
from transformers import GenerationConfig

import hf_paged

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MULTI_BYTE_TOKENS = 32


def greedy(n: int = NEW_TOKENS, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, **kw)


@pytest.fixture(scope="module")
def engine(paged):
    model, tokenizer = paged
    return hf_paged.Engine(model, tokenizer=tokenizer, num_blocks=128, block_size=16)


def streamed(engine, prompt: list[int], config: GenerationConfig) -> tuple[str, list[int], str | None]:
    text, ids, reason = "", [], None
    for delta in engine.stream([prompt], config):
        text, ids, reason = text + (delta.text or ""), ids + delta.token_ids, delta.finish_reason or reason
    return text, ids, reason


# ----- stop strings ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def answer(tokenizer, oracle) -> Answer:
    prompt = chat_ids(tokenizer, CHATS["sea"])
    return Answer(tokenizer, prompt, oracle.greedy(prompt))


@pytest.mark.parametrize("case", ["spans_two_tokens", "begins_mid_token", "several_at_once"])
def test_stop_strings_cut_the_text_and_the_tokens_as_openai_does(engine, tokenizer, answer, case):
    stops, stop_at = answer.stops()[case]
    config = greedy(stop_strings=stops)
    [out] = engine.generate([answer.prompt], config)
    assert out.finish_reason == "stop"
    assert_openai_stop(tokenizer, answer, out.text, out.token_ids, stop_at)
    text, ids, reason = streamed(engine, answer.prompt, config)
    assert (text, ids, reason) == (out.text, out.token_ids, "stop")


# ----- multi-byte text -------------------------------------------------------------------------------------------

def test_streamed_multi_byte_text_is_byte_identical_to_the_finished_text(engine, tokenizer):
    names = sorted(MULTI_BYTE_CHATS)
    prompts = [chat_ids(tokenizer, MULTI_BYTE_CHATS[name]) for name in names]
    config = greedy(MULTI_BYTE_TOKENS)
    outs = engine.generate(prompts, config)
    engine.add_requests(prompts, config, request_ids=names)
    texts, ids, reasons = dict.fromkeys(names, ""), {n: [] for n in names}, dict.fromkeys(names)
    for delta in engine.stream():  # one stream of all three, their deltas interleaved
        texts[delta.request_id] += delta.text or ""
        ids[delta.request_id] += delta.token_ids
        reasons[delta.request_id] = delta.finish_reason or reasons[delta.request_id]
    for name, out in zip(names, outs, strict=True):
        assert out.text == decode(tokenizer, out.token_ids)
        assert any(ord(ch) > 127 for ch in out.text), out.text  # the chat does produce multi-byte text
        assert texts[name].encode("utf-8") == out.text.encode("utf-8")
        assert (ids[name], reasons[name]) == (out.token_ids, out.finish_reason)
    # and the comparison means something: some character's bytes arrive in more than one token
    assert any("\ufffd" in decode(tokenizer, [t]) for out in outs for t in out.token_ids)


# ----- prefix caching ---------------------------------------------------------------------------------------------

def test_prefix_caching_on_a_shared_system_prompt_gives_the_same_tokens_and_hits(paged):
    model, tokenizer = paged
    prompts = [chat_ids(tokenizer, [{"role": "system", "content": HANDBOOK}, {"role": "user", "content": q}])
               for q in HANDBOOK_QUESTIONS]
    shared = len(os.path.commonprefix(prompts))
    assert shared > 150
    tokens = {}
    for caching in (False, True):
        engine = hf_paged.Engine(model, tokenizer=tokenizer, num_blocks=128, block_size=16,
                                 enable_prefix_caching=caching)
        first = engine.generate(prompts[:1], greedy(12))  # its blocks are cached when it is done
        rest = engine.generate(prompts[1:], greedy(12))
        tokens[caching] = [o.token_ids for o in first + rest]
        hits = engine.stats()["prefix_cache_hit_tokens"]
        assert hits >= (len(prompts) - 1) * (shared // 16 * 16) if caching else hits == 0
    assert tokens[True] == tokens[False]
