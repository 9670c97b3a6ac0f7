"""Stop strings, table-driven: the returned text, the token ids, the streamed deltas and the token count agree with a
reference implementation of OpenAI's semantics on hand-made byte-level tokens.

The semantics: generation stops once the text of complete characters produced so far holds a stop string (or at an
EOS, or at ``max_new_tokens``); the text is cut before the first stop string; the tokens are kept up to and including
the one in which it begins (so that they cover the text, and ``usage.completion_tokens`` counts them). Tokens here are
raw byte strings, so a character can be split over tokens, a token can end one character and begin the next, and
bytes can be invalid UTF-8 (decoded as U+FFFD, as a random model's byte-level output is).
"""

from __future__ import annotations

import random

import pytest
from transformers import GenerationConfig

import hf_paged
from scripted_model import ScriptedModel

ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
BOS, SPECIAL = b"<s>", b"<special>"


class PieceTokenizer:
    """Each token is a byte string; text is their bytes decoded as UTF-8, broken bytes as U+FFFD, special tokens
    skipped."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = [BOS, SPECIAL] + sorted(set(pieces) - {BOS, SPECIAL})
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        keep = [self.pieces[i] for i in ids if not (skip_special_tokens and i < 2)]
        return b"".join(keep).decode("utf-8", errors="replace")


def reference(tok: PieceTokenizer, ids: list[int], stops: list[str], eos: set[int], max_new: int):
    """``(token ids, text, finish reason)`` by the semantics, token by token, written for clarity."""
    text = lambda k: tok.decode(ids[:k], skip_special_tokens=True)
    for k in range(1, max_new + 1):
        last = ids[k - 1] in eos or k == max_new
        t = text(k)
        if not last and t.endswith("\ufffd"):
            continue  # an unfinished character is not text yet
        found = [i for i in (t.find(s) for s in stops) if i >= 0]
        if found:
            at = min(found)
            begins = min(j for j in range(1, k + 1) if len(text(j)) > at)  # the token in which the stop begins
            return ids[:begins], t[:at], "stop"
        if last:
            return ids[:k], t, "stop" if ids[k - 1] in eos else "length"
    raise AssertionError("unreachable")


E4B8AD, E69687 = "中".encode(), "文".encode()
SMILE = "🙂".encode()  # 4 bytes
# (name, the tokens the model says, stop strings, EOS pieces)
CASES = [
    ("inside one token", [b"He", b"llo", b" wor", b"ld", b"!"], ["lo w"], []),
    ("spans three tokens", [b"a", b"bc", b"d", b"ef", b"g"], ["cde"], []),
    ("at the first character", [b"xy", b"z", b"w"], ["x"], []),
    ("a whole token", [b"ab", b"cd", b"ef"], ["cd"], []),
    ("ends a token", [b"ab", b"cd", b"ef"], ["bcd"], []),
    ("begins in a split character", [b"x", E4B8AD[:1], E4B8AD[1:2], E4B8AD[2:], b"y", b"z"], ["中y"], []),
    ("after a split character", [b"x", E4B8AD[:2], E4B8AD[2:], b"y", b"z"], ["y"], []),
    ("a token ends one character and begins the next",
     [E4B8AD[:2], E4B8AD[2:] + E69687[:1], E69687[1:], b"!", b"?"], ["文"], []),
    ("the second half of a token's characters", [E4B8AD + E69687, b"!", b"?"], ["文!"], []),
    ("a 4-byte character split 1 + 3", [b"ok ", SMILE[:1], SMILE[1:], b" end", b"."], ["🙂 e"], []),
    ("a 4-byte character split byte by byte", [b"a"] + [SMILE[i:i + 1] for i in range(4)] + [b"b", b"c"], ["🙂"],
     []),
    ("after invalid bytes (a random model)", [b"\x87"] * 6 + [b"\x8a", b"b", b"b", b"c"], ["bb"], []),
    ("a stop made of U+FFFD", [b"a", b"\x87", b"\x87", b"c", b"d"], ["\ufffd"], []),
    ("the earliest of two stops", [b"ab", b"cd", b"ef", b"gh"], ["fg", "cde"], []),
    ("the stop completed first wins", [b"ab", b"c", b"d", b"e"], ["abcd", "c"], []),
    ("overlapping occurrences", [b"aa", b"a", b"ab"], ["aab"], []),
    ("a special token before the stop", [b"ab", SPECIAL, b"cd", b"ef"], ["bc"], []),
    ("a special token inside the stop", [b"ab", b"c", SPECIAL, b"de", b"f"], ["cd"], []),
    ("an EOS that completes the stop", [b"ab", b"cd", b"!", b"zz"], ["d!"], [b"!"]),
    ("an EOS in which the stop begins", [b"ab", b"c", b"!x", b"zz"], ["!x"], [b"!x"]),
    ("an EOS before the stop completes", [b"ab", b"c", b"!", b"de"], ["c!d"], [b"!"]),
    ("a special EOS, no stop", [b"ab", b"cd", SPECIAL, b"ef"], ["zz"], [SPECIAL]),
    ("never completed", [b"ab", b"cd", b"ef"], ["efg"], []),
    ("completed by the last token allowed", [b"ab", b"cd", b"ef", b"gh"], ["def"], []),
    ("the last token allowed ends inside a character", [b"ab", E4B8AD[:2], E4B8AD[2:]], ["b中"], []),
]


def run_case(pieces, stops, eos_pieces, async_scheduling, max_new=None):
    tok = PieceTokenizer(pieces + eos_pieces)
    ids = [tok.ids[p] for p in pieces]
    eos = {tok.ids[p] for p in eos_pieces}
    max_new = max_new or len(ids) - 1  # (the script's last token is never reached: "completed by the last token")
    model = ScriptedModel([0] + ids, len(tok.pieces))
    engine = hf_paged.Engine(model, num_blocks=16, block_size=4, tokenizer=tok, async_scheduling=async_scheduling)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, stop_strings=stops,
                              eos_token_id=sorted(eos) or None)
    want = reference(tok, ids, stops, eos, max_new)
    return engine, tok, config, want


@ASYNC
@pytest.mark.parametrize("name, pieces, stops, eos", CASES, ids=[c[0] for c in CASES])
def test_text_tokens_and_deltas_follow_the_reference(name, pieces, stops, eos, async_scheduling):
    engine, tok, config, (want_ids, want_text, want_reason) = run_case(pieces, stops, eos, async_scheduling)
    out = engine.generate([[0]], config)[0]
    assert (out.token_ids, out.text, out.finish_reason) == (want_ids, want_text, want_reason)
    if want_reason == "stop" and want_text != tok.decode(want_ids, skip_special_tokens=True):
        assert tok.decode(want_ids, skip_special_tokens=True).startswith(want_text)  # the tokens cover the text

    deltas = list(engine.stream([[0]], config))
    assert [t for d in deltas for t in d.token_ids] == want_ids
    assert "".join(d.text for d in deltas) == want_text
    assert deltas[-1].finish_reason == want_reason and not any(d.finished for d in deltas[:-1])
    shown_ids, shown_text = [], ""
    for d in deltas[:-1]:  # before the last, every delta's text is the text of its tokens
        shown_ids, shown_text = shown_ids + d.token_ids, shown_text + d.text
        assert shown_text == tok.decode(shown_ids, skip_special_tokens=True)
        assert d.token_ids, "a delta with text but no tokens"
    assert engine.stats()["used_blocks"] == 0


@ASYNC
def test_step_with_deltas_and_outputs_count_the_same_tokens(async_scheduling):
    """What a server reads: the deltas of ``step_with_deltas`` add up to the output's tokens and text, whose length is
    the usage count, for the issue's case (a random byte-level model's U+FFFD run, then the stop)."""
    pieces = [b"\x87"] * 12 + [b"\x8a", b"b", b"b", b"b"]
    engine, tok, config, (want_ids, want_text, _) = run_case(pieces, ["bb"], [], async_scheduling)
    assert want_text == "\ufffd" * 13 and len(want_ids) == 14
    engine.add_request([0], config)
    ids, text, outputs = [], "", []
    while engine.has_unfinished():
        outs, deltas = engine.step_with_deltas()
        outputs += outs
        for d in deltas:
            ids, text = ids + d.token_ids, text + d.text
    (out,) = outputs
    assert out.token_ids == ids == want_ids and out.text == text == want_text


@pytest.mark.parametrize("seed", range(16))
def test_random_byte_tokens_follow_the_reference(seed):
    """Random splits of text with multi-byte characters (and stray invalid bytes) into tokens of 1 to 4 bytes, and
    stop strings taken from the text itself, so that they occur at random places."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "b", " ", "é", "中", "🙂", "\x87"]) for _ in range(14))
    data = b"".join(b"\x87" if ch == "\x87" else ch.encode() for ch in text)
    pieces, i = [], 0
    while i < len(data):
        n = rng.randint(1, 4)
        pieces.append(data[i : i + n])
        i += n
    pieces.append(b"!")
    whole = b"".join(pieces).decode("utf-8", errors="replace")
    stops = []
    for _ in range(rng.randint(1, 2)):
        at = rng.randrange(len(whole) - 1)
        stops.append(whole[at : at + rng.randint(1, 3)])
    engine, tok, config, want = run_case(pieces, stops, [], async_scheduling=bool(seed % 2))
    out = engine.generate([[0]], config)[0]
    assert (out.token_ids, out.text, out.finish_reason) == want
    deltas = list(engine.stream([[0]], config))
    assert ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)) == want[:2]


def test_the_reference_itself():
    """The reference on cases worked by hand."""
    tok = PieceTokenizer([b"He", b"llo", b" wor", b"ld"])
    ids = [tok.ids[p] for p in (b"He", b"llo", b" wor", b"ld")]
    assert reference(tok, ids, ["lo w"], set(), 4) == (ids[:2], "Hel", "stop")
    assert reference(tok, ids, ["zz"], set(), 3) == (ids[:3], "Hello wor", "length")
    split = PieceTokenizer([E4B8AD[:1], E4B8AD[1:]])
    ids = [split.ids[E4B8AD[:1]], split.ids[E4B8AD[1:]]]
    assert reference(split, ids, ["中"], set(), 2) == (ids[:1], "", "stop")
