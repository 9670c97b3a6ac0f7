"""Structured output: a request's new text held to a JSON schema by masking, at each step, the tokens its grammar
does not allow (``GenerationConfig(json_schema=...)``; the server's ``response_format``).

The grammar library is llguidance (``pip install llguidance``, in the ``serve`` extra), imported when a request
first asks. A schema is compiled and checked once, when the first request that names it is added, on the thread that
adds it (a ``ValueError`` names what is wrong, nothing is queued); each sequence keeps its own matcher, a copy of the
compiled one, which the engine advances with every token it takes in and asks for the next mask before the step that
samples it.
"""

from __future__ import annotations

import functools

import torch

INSTALL_HINT = "structured output (json_schema, response_format) needs llguidance: pip install llguidance"


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise ValueError(f"{INSTALL_HINT} ({exc})") from None
    return llguidance


class StructuredOutput:
    """Grammars and matchers for one tokenizer (vocabulary of ``vocab_size`` ids, the model's)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def _tokenizer(self):
        llg = _llguidance()
        try:
            return llg.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        except Exception as exc:  # (a slow tokenizer, say)
            raise ValueError(f"structured output cannot use this tokenizer: {exc}") from None

    @functools.lru_cache(maxsize=64)
    def compiled(self, json_schema: str):
        """The matcher of ``json_schema`` before any token, compiled once per schema (milliseconds, up to a second
        for a large schema; the grammar library lets other threads run meanwhile, so a caller off the step loop
        delays no step); ``ValueError`` saying why it cannot be compiled. Never advanced: :meth:`matcher` copies it."""
        if self.tokenizer is None:
            raise ValueError("json_schema needs a tokenizer: create the Engine with tokenizer=...")
        llg, tokenizer = _llguidance(), self._tokenizer
        try:
            # no free whitespace between JSON tokens: a weak model would otherwise pad with spaces until its limit
            grammar = llg.LLMatcher.grammar_from_json_schema(json_schema, defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise ValueError(f"json_schema is not a JSON object: {exc}") from None
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"json_schema cannot be compiled: {matcher.get_error()}")
        return matcher

    def matcher(self, json_schema: str | None):
        """A fresh matcher of ``json_schema`` for one sequence: a copy of the compiled one (microseconds, so the
        ``n`` copies of a request cost the step that forks them next to nothing); None without a schema."""
        return None if json_schema is None else self.compiled(json_schema).deep_copy()


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """``[G, vocab_size]`` bool: the tokens each matcher allows next (host tensor)."""
    lt = _llguidance().torch
    bits = lt.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        lt.fill_next_token_bitmask(m, bits, i)
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def advance(matcher, token: int, eos_token_ids) -> tuple[str | None, str | None]:
    """Take ``token`` into a sequence's ``matcher``: ``(finish reason, error)``, ``"stop"`` once the grammar is
    complete (nothing may follow), ``"error"`` if it refuses the token (its mask allowed nothing the sampler could
    pick); an EOS is not the grammar's to take."""
    if token in eos_token_ids:
        return None, None
    if not matcher.consume_token(token):
        return "error", f"the structured-output grammar refused a token: {matcher.get_error()}"
    return ("stop", None) if matcher.is_stopped() else (None, None)
