"""``Detokenizer``: the text of a sequence's generated tokens, built as they come, and stop strings cut from it.

Decoding each new token alone breaks text: a character split over several byte-level tokens decodes to U+FFFD
until its last byte arrives, and a SentencePiece token's leading space is dropped when it is decoded first. So the
text is grown through a window: the tokens read last time (``prefix_offset:read_offset``) are decoded with and
without the new ones and the difference is the new text; text ending in U+FFFD is held back until the character
is complete. Special tokens are skipped, as in the final text. The streamed pieces therefore concatenate to the
final text, and the final text of a request that was never streamed is one ``decode`` of all its tokens.

Stop strings (OpenAI style): the text is cut before the first stop string, and the tokens before the token in
which it begins are kept (that token's text before the stop string stays in the text). While a request with stop
strings is streamed, its last ``len(longest stop string) - 1`` characters are held back, and the tokens whose text
is not out yet with them, so no delta shows text that the stop string later cuts.
"""

from __future__ import annotations

import bisect

from hf_paged.engine._sequence import Sequence


class TextState:
    """One sequence's text so far: ``text`` is the text of its first ``read_offset`` generated tokens, ``ends[i]``
    the length of ``text`` once token ``i`` was read; ``sent`` characters were streamed; ``stop_at`` is where
    the first stop string begins (None: none found)."""

    __slots__ = ("prefix_offset", "read_offset", "text", "ends", "sent", "stop_at")

    def __init__(self) -> None:
        self.prefix_offset = self.read_offset = self.sent = 0
        self.text = ""
        self.ends: list[int] = []
        self.stop_at: int | None = None


class Detokenizer:
    """Incremental detokenization with ``tokenizer`` (a transformers tokenizer); state lives on each sequence."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    @staticmethod
    def state(seq: Sequence) -> TextState:
        if seq.text_state is None:
            seq.text_state = TextState()
        return seq.text_state

    def read(self, seq: Sequence, flush: bool = False) -> int:
        """Take in the tokens not read yet (all of them with ``flush``, else up to a complete character); returns
        the length of the text before."""
        st, tokens = self.state(seq), seq.output_token_ids
        before = len(st.text)
        if st.read_offset >= len(tokens):
            return before
        prefix = self._decode(tokens[st.prefix_offset : st.read_offset])
        full = self._decode(tokens[st.prefix_offset :])
        if not flush and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return before  # nothing visible yet, or an unfinished character: wait for more tokens
        st.text += full[len(prefix) :]
        st.ends += [len(st.text)] * (len(tokens) - st.read_offset)
        st.prefix_offset, st.read_offset = st.read_offset, len(tokens)
        return before

    def stop_string_found(self, seq: Sequence) -> bool:
        """Read the newest tokens and look for a stop string in the text they may have completed."""
        st, stops = self.state(seq), seq.params.stop_strings
        before = self.read(seq)
        if len(st.text) == before:
            return False
        start = max(0, before - max(len(s) for s in stops) + 1)
        found = [i for i in (st.text.find(s, start) for s in stops) if i >= 0]
        if found:
            st.stop_at = min(found)
        return bool(found)

    def final(self, seq: Sequence) -> tuple[int, str]:
        """``(number of tokens kept, text)`` of a finished sequence (cut before a stop string if one stopped it)."""
        st = self.state(seq)
        self.read(seq, flush=True)
        if st.stop_at is None:
            return len(seq.output_token_ids), st.text
        return bisect.bisect_right(st.ends, st.stop_at), st.text[: st.stop_at]

    def ready(self, seq: Sequence) -> tuple[int, int]:
        """``(tokens, characters)`` of an unfinished sequence that a stream may show now."""
        st = self.state(seq)
        self.read(seq)
        stops = seq.params.stop_strings
        shown = max(st.sent, len(st.text) - (max(len(s) for s in stops) - 1 if stops else 0))
        return max(seq.num_streamed, bisect.bisect_right(st.ends, shown)), shown
