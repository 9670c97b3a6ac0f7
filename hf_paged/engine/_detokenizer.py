"""``Detokenizer``: the text of a sequence's generated tokens, built as they come, and stop strings cut from it.

Decoding each new token alone breaks text: a character split over several byte-level tokens decodes to U+FFFD
until its last byte arrives, and a SentencePiece token's leading space is dropped when it is decoded first. So the
text is grown through a window: the tokens read last time (``prefix_offset:read_offset``) are decoded with and
without the new ones and the difference is the new text; text ending in U+FFFD is held back until the character
is complete. Special tokens are skipped, as in the final text. The streamed pieces therefore concatenate to the
final text, and the final text of a request that was never streamed is one ``decode`` of all its tokens.

Stop strings (OpenAI style): the text is cut before the first stop string, and the tokens are kept up to and
including the token in which it begins (a stop string that begins inside a token, or inside a character whose bytes
span tokens, keeps that token: the kept tokens cover the text). Each read token's text end is known exactly
(``TextState.ends``, kept on the sequence; a token of an unfinished character ends after that character), so the cut
is the same however the tokens arrived. While a request with stop strings is streamed, its last
``len(longest stop string) - 1`` characters are held back with the tokens they came from, so no delta shows text or
tokens that the stop string later cuts: a delta's text is always the text of its tokens.
"""

from __future__ import annotations

import bisect

from hf_paged.engine._sequence import Sequence


class Detokenizer:
    """Incremental detokenization with ``tokenizer`` (a transformers tokenizer); state lives on each sequence."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def read(self, seq: Sequence, flush: bool = False) -> None:
        """Take in the tokens not read yet (all of them with ``flush``, else up to a complete character) and look
        for a stop string in the text they add."""
        st, tokens = seq.text_state, seq.output_token_ids
        before = len(st.text)
        if st.read_offset >= len(tokens):
            return
        window = tokens[st.prefix_offset :]
        prefix = self._decode(window[: st.read_offset - st.prefix_offset])
        full = self._decode(window)
        if not flush and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return  # nothing visible yet, or an unfinished character: wait for more tokens
        # where the text ends through each new token, read together (the text grows from ``before`` to ``end``):
        # decoded one prefix at a time (a token that ends inside a character ends after it, as its U+FFFD stands for
        # it), kept in order and within the chunk; a single token ends at ``end``, with no decode
        end, last = before + len(full) - len(prefix), before
        for j in range(st.read_offset - st.prefix_offset + 1, len(window)):
            last = min(max(last, before + len(self._decode(window[:j])) - len(prefix)), end)
            st.ends.append(last)
        st.ends.append(end)
        st.text += full[len(prefix) :]
        st.prefix_offset, st.read_offset = st.read_offset, len(tokens)
        if (stops := seq.params.stop_strings) and st.stop_at is None:
            start = max(0, before - max(map(len, stops)) + 1)
            st.stop_at = min((i for i in (st.text.find(s, start) for s in stops) if i >= 0), default=None)

    def shown(self, seq: Sequence, final: bool) -> tuple[int, int]:
        """``(tokens, characters)`` of ``seq``'s generated tokens and text that may be shown: of a finished sequence
        (``final``) all of them, cut before a stop string (the token in which it begins kept); of an unfinished one
        what a stream may show now, whole tokens and their text short of the tail a stop string may still cut."""
        st = seq.text_state
        self.read(seq, flush=final)
        if final:
            if st.stop_at is None:
                return len(seq.output_token_ids), len(st.text)
            return bisect.bisect_right(st.ends, st.stop_at) + 1, st.stop_at
        stops = seq.params.stop_strings
        limit = len(st.text) - (max(map(len, stops)) - 1 if stops else 0)
        kept = max(seq.num_streamed, bisect.bisect_right(st.ends, limit))
        return kept, max(st.sent, st.ends[kept - 1] if kept else 0)
