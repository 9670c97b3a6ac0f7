"""``StopChecker``: whether a sequence is done after its newest token (EOS, a stop string, or its length limit)."""

from __future__ import annotations

from hf_paged.engine.sequence import Sequence


class StopChecker:
    """Host-side checks on the tokens already copied back; stop strings need the ``tokenizer``."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def finish_reason(self, seq: Sequence) -> str | None:
        """``"stop"``, ``"length"`` or None (keep going). EOS cannot come before ``min_new_tokens``: the sampler
        suppresses it."""
        params = seq.params
        if seq.token_ids[-1] in params.eos_token_ids:
            return "stop"
        if params.stop_strings and self._ends_with_stop_string(seq):
            return "stop"
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.max_new_tokens:
            return "length"
        return None

    def _ends_with_stop_string(self, seq: Sequence) -> bool:
        # A token is at least one character long or part of one, so the newest longest-stop + 8 tokens hold any
        # stop string that the newest token completes; earlier ones would have stopped the sequence already.
        longest = max(len(s) for s in seq.params.stop_strings)
        tail = self.tokenizer.decode(seq.output_token_ids[-(longest + 8) :])
        return any(s in tail for s in seq.params.stop_strings)
