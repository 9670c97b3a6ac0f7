"""Per-request sampling settings, read once from a ``transformers.GenerationConfig`` and checked at ``add_request``."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

from transformers import GenerationConfig


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop checks.

    ``top_k == 0``, ``top_p == 1.0``, ``min_p == 0.0`` and ``repetition_penalty == 1.0`` mean off. With
    ``do_sample=False`` the request is greedy (repetition penalty and ``min_new_tokens`` still apply, as in
    ``model.generate``). ``seed`` makes a sampled request reproducible whatever its batch neighbours are.
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    num_return_sequences: int = 1
    logprobs: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        _check(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens,
               f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(not (self.do_sample and self.temperature == 0),
               "temperature=0 with do_sample=True: use do_sample=False for greedy decoding")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(isinstance(self.num_return_sequences, int) and self.num_return_sequences >= 1,
               f"num_return_sequences must be a positive integer, got {self.num_return_sequences!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and self.seed >= 0),
               f"seed must be a non-negative integer or None, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               f"stop_strings must be non-empty strings, got {self.stop_strings!r}")

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample

    @functools.cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to adjust the logits: the sampler's one-argmax fast path."""
        return not self.do_sample and self.repetition_penalty == 1.0 and not (
            self.min_new_tokens and self.eos_token_ids)

    @classmethod
    def from_generation_config(
        cls, config: GenerationConfig, prompt_len: int, model_config: GenerationConfig | None = None
    ) -> SamplingParams:
        """Resolve ``config`` the way ``model.generate`` does (user > model's generation config > global defaults).

        ``max_new_tokens`` falls back to ``max_length - prompt_len`` (at least 1). A seed may be set as a custom
        attribute (``GenerationConfig(seed=0)``); logprobs with ``output_logprobs=True`` or ``output_scores=True``.
        """
        gc = resolve_generation_config(config, model_config)
        max_new = gc.max_new_tokens
        if max_new is None:
            max_new = max(1, (gc.max_length or 20) - prompt_len)
        min_new = gc.min_new_tokens
        if min_new is None:
            min_new = max(0, (gc.min_length or 0) - prompt_len)
        if (gc.num_beams or 1) > 1:
            raise ValueError("beam search (num_beams > 1) is not served by the engine; use model.generate with a "
                             "PagedAttentionCache for beam search")
        stop = gc.stop_strings
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        return cls(
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            do_sample=bool(gc.do_sample),
            temperature=_num(gc.temperature, 1.0),
            top_k=_num(gc.top_k, 0),
            top_p=_num(gc.top_p, 1.0),
            min_p=_num(gc.min_p, 0.0),
            repetition_penalty=_num(gc.repetition_penalty, 1.0),
            seed=getattr(gc, "seed", None),
            eos_token_ids=_eos_tuple(gc.eos_token_id),
            stop_strings=stop,
            num_return_sequences=_num(gc.num_return_sequences, 1),
            logprobs=bool(getattr(gc, "output_logprobs", False) or gc.output_scores),
        )


def resolve_generation_config(config: GenerationConfig | None, model_config: GenerationConfig | None):
    """Fill the unset fields of ``config`` from ``model_config`` then from transformers' global defaults."""
    gc = GenerationConfig() if config is None else copy.deepcopy(config)
    if model_config is not None:
        gc.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    gc.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    return gc


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in (eos.tolist() if hasattr(eos, "tolist") else eos))


def _num(value, default):
    return default if value is None else value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
