"""``StopChecker``: whether a sequence is done after its newest token (EOS, a stop string, or its length limit)."""

from __future__ import annotations

from hf_paged.engine._detokenizer import Detokenizer
from hf_paged.engine._sequence import Sequence


class StopChecker:
    """Host-side checks on the tokens already copied back; stop strings need the ``tokenizer``."""

    def __init__(self, tokenizer=None):
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None

    def finish_reason(self, seq: Sequence) -> str | None:
        """``"stop"``, ``"length"`` or None (keep going). EOS cannot come before ``min_new_tokens``: the sampler
        suppresses it."""
        params = seq.params
        eos = seq.token_ids[-1] in params.eos_token_ids
        length = len(seq.token_ids) - seq.num_prompt_tokens >= params.max_new_tokens
        # (before the EOS: an EOS that is not a special token has text, which may complete a stop string); all the
        # tokens are read when the sequence ends with this one anyway
        if params.stop_strings:
            self.detokenizer.read(seq, flush=eos or length)
            if seq.text_state.stop_at is not None:
                return "stop"
        return "stop" if eos else "length" if length else None
