"""Streaming text: deltas concatenate to the final text (no broken multi-byte characters, SentencePiece spaces
right, special tokens skipped as in the final text), and stop strings are cut from the text and the tokens
(``test_stop_strings.py`` holds the table of edge cases).

A scripted model emits a chosen token sequence (the encoding of a chosen text with a real tokenizer built offline),
so the expected text, and where a stop string cuts it, are known exactly.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig, PreTrainedTokenizerFast

import hf_paged
from hf_paged.cli.default_model import byte_tokenizer
from scripted_model import ScriptedModel

ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
TEXT = "Héllo wörld, 中文 and 🙂 ok; the end is near and the end"


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style word tokenizer: a word's token carries its leading space as '▁' (Metaspace), so a
    token decoded alone loses the space, and some pieces start inside a word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["Héllo", "wörld", "中文", "and", "🙂", "ok", "the", "end", "is", "near"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", ",", ";"])}
    vocab.update({"▁" + w: len(vocab) + i for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


TOKENIZERS = {"bytes": byte_tokenizer, "metaspace": metaspace_tokenizer}


def scripted_engine(kind: str, async_scheduling: bool, text: str = TEXT, special_at: int | None = None):
    """An engine whose model continues the 1-token prompt with the tokens of ``text`` (and a special token at
    position ``special_at``); returns (engine, tokenizer, prompt, generated tokens)."""
    tok = TOKENIZERS[kind]()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and "<unk>" not in tok.convert_ids_to_tokens(ids)
    if special_at is not None:
        ids.insert(special_at, tok.bos_token_id)
    script = [tok.bos_token_id] + ids
    model = ScriptedModel(script, len(tok))
    engine = hf_paged.Engine(model, num_blocks=64, block_size=4, tokenizer=tok, async_scheduling=async_scheduling)
    return engine, tok, script[:1], ids


def stream_one(engine, prompt, config):
    deltas = list(engine.stream([prompt], config))
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    return deltas


@ASYNC
@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_stream_text_concatenates_to_the_final_text_without_broken_characters(kind, async_scheduling):
    engine, tok, prompt, ids = scripted_engine(kind, async_scheduling)
    config = GenerationConfig(max_new_tokens=len(ids), do_sample=False)
    deltas = stream_one(engine, prompt, config)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == TEXT
    assert not any("\ufffd" in d.text for d in deltas), "a delta with a broken character"
    if kind == "bytes":  # multi-byte characters arrive byte by byte: some steps show no text yet
        assert len(deltas) < len(ids)
    out = engine.generate([prompt], config)[0]
    assert out.text == TEXT and out.token_ids == ids and out.finish_reason == "length"


@ASYNC
@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_special_tokens_are_skipped_in_deltas_as_in_the_final_text(kind, async_scheduling):
    engine, tok, prompt, ids = scripted_engine(kind, async_scheduling, special_at=2)  # bytes: inside 'é'

    config = GenerationConfig(max_new_tokens=len(ids), do_sample=False)
    deltas = stream_one(engine, prompt, config)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == TEXT == tok.decode(ids, skip_special_tokens=True)
    assert engine.generate([prompt], config)[0].text == TEXT


def expected_cut(tok, ids: list[int], stop: str) -> tuple[list[int], str]:
    """The oracle: the text before the first ``stop``, and the tokens up to the one in which it begins."""
    idx = TEXT.index(stop)
    kept = min(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k], skip_special_tokens=True)) > idx)
    return ids[:kept], TEXT[:idx]


@ASYNC
@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("stop", [" the end", "örl", "中", "end is", "🙂"], ids=repr)
def test_stop_strings_are_cut_from_the_text_and_the_tokens(kind, async_scheduling, stop):
    engine, tok, prompt, ids = scripted_engine(kind, async_scheduling)
    want_tokens, want_text = expected_cut(tok, ids, stop)
    config = GenerationConfig(max_new_tokens=len(ids), do_sample=False, stop_strings=[stop, "never seen"])
    out = engine.generate([prompt], config)[0]
    assert out.finish_reason == "stop" and out.text == want_text and out.token_ids == want_tokens
    deltas = stream_one(engine, prompt, config)
    assert "".join(d.text for d in deltas) == want_text, "a delta showed text the stop string cut"
    assert [t for d in deltas for t in d.token_ids] == want_tokens
    assert engine.stats()["used_blocks"] == 0


@ASYNC
def test_a_stop_string_never_seen_cuts_nothing(async_scheduling):
    engine, tok, prompt, ids = scripted_engine("bytes", async_scheduling)
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=8, do_sample=False, stop_strings=["zzz"]))[0]
    assert out.finish_reason == "length" and out.token_ids == ids[:8] and out.text == tok.decode(ids[:8])
