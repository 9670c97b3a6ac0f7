"""Per-request sampling settings, read once from a ``transformers.GenerationConfig`` and checked at ``add_request``."""

from __future__ import annotations

import copy
import functools
import json
import math
import numbers
from dataclasses import dataclass

from transformers import GenerationConfig

from hf_paged import _compat
from hf_paged.engine import _validation as validation

#: Most tokens a request may ask for (token counts and positions are int32 on the device).
MAX_TOKENS = 2**31 - 1
#: Most copies of one prompt (``num_return_sequences``): all of them are made in the step that computes the prompt.
MAX_RETURN_SEQUENCES = 1024
#: The most alternatives a token's log-probability comes with (OpenAI's chat API allows 20).
MAX_TOP_LOGPROBS = 20
#: The integer settings: the smallest and largest value each takes, and how its range reads in errors ("None": unset
#: is allowed).
_INT_RANGES = {
    "max_new_tokens": (1, MAX_TOKENS, "[1, 2**31 - 1]"), "min_new_tokens": (0, MAX_TOKENS, "[0, 2**31 - 1]"),
    "top_k": (0, 2**63 - 1, "[0, 2**63)"),
    "num_return_sequences": (1, MAX_RETURN_SEQUENCES, f"[1, {MAX_RETURN_SEQUENCES}] (for more copies, add the prompt "
                                                      "several times)"),
    "seed": (0, 2**64 - 1, "[0, 2**64) or None"), "top_logprobs": (0, MAX_TOP_LOGPROBS, f"[0, {MAX_TOP_LOGPROBS}]"),
    "prompt_logprobs": (0, MAX_TOP_LOGPROBS, f"[0, {MAX_TOP_LOGPROBS}] or None"),
}


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop checks.

    ``top_k == 0``, ``top_p == 1.0``, ``min_p == 0.0`` and ``repetition_penalty == 1.0`` mean off. With
    ``do_sample=False`` the request is greedy (repetition penalty and ``min_new_tokens`` still apply, as in
    ``model.generate``). ``seed`` makes a sampled request reproducible whatever its batch neighbours are.
    ``top_logprobs``: with ``logprobs``, each new token's ``top_logprobs`` likeliest alternatives too;
    ``prompt_logprobs`` (None: off): the log-probability of every prompt token after the first, and that many
    alternatives; ``json_schema`` (a JSON schema as JSON text, None: off): the new text is masked to match it.
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
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    json_schema: str | None = None

    def __post_init__(self) -> None:
        for name in _INT_RANGES:
            _in_range(name, getattr(self, name))
        for name in ("do_sample", "logprobs"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in _REALS:
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                   f"{name} must be a finite number, got {value!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(not (self.do_sample and self.temperature == 0),
               "temperature=0 with do_sample=True: use do_sample=False for greedy decoding")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(all(_is_int(e) and e >= 0 for e in self.eos_token_ids),
               f"eos_token_id must be non-negative integers, got {list(self.eos_token_ids)!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        for i, s in enumerate(self.stop_strings):
            validation.text(s, f"stop_strings[{i}]")
        _check(self.json_schema is None or isinstance(self.json_schema, str),
               f"json_schema must be a JSON schema (a dict or its JSON text) or None, got {self.json_schema!r}")

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample

    @functools.cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to adjust the logits: the sampler's one-argmax fast path."""
        return not self.do_sample and self.repetition_penalty == 1.0 and not (
            self.min_new_tokens and self.eos_token_ids) and self.json_schema is None

    @functools.cached_property
    def reads_own_tokens(self) -> bool:
        """The logits of the next token depend on the tokens before it on the host (a repetition penalty, a grammar):
        a step with this request waits for its in-flight token first."""
        return self.repetition_penalty != 1.0 or self.json_schema is not None

    @functools.cached_property
    def stops_on_eos_or_length(self) -> bool:
        """No stop strings, logprobs or grammar: the host's work per new token is an EOS check and a length check."""
        return not self.stop_strings and not self.logprobs and self.json_schema is None

    @staticmethod
    def resolve(config: GenerationConfig | None, model_config: GenerationConfig | None = None) -> GenerationConfig:
        """Resolve ``config`` the way ``model.generate`` does (user > model's generation config > global defaults),
        the prompt-independent half of reading it: refuse the settings of ``config`` as given that the engine
        ignores, and values of the wrong type before transformers' own checks meet them (they raise ``TypeError``,
        and ``bool("no")`` is True); fill the unset fields from ``model_config``, then from transformers' global
        defaults (a deep copy and two dict merges: worth doing once for many prompts of one config)."""
        if config is not None:
            if unserved := [f"{k}={v!r}" for k, off in UNSERVED.items()
                            if (v := getattr(config, k, None)) not in (None, off)]:
                raise ValueError(f"the engine does not apply {', '.join(unserved)}; unset it, or use model.generate "
                                 "with a PagedAttentionCache, which applies every generation setting")
            _typed(config)
        try:
            gc = GenerationConfig() if config is None else copy.deepcopy(config)
            # num_return_sequences is merged apart: update() runs transformers' check, which refuses copies of a greedy
            # request (as model.generate does); transformers' generate_batch serves them, as identical copies, and so
            # does the engine
            copies, gc.num_return_sequences = gc.num_return_sequences, None
            layers = ([(model_config.to_dict(), True)] if model_config is not None else []) + [
                (dict(_compat.default_generation_params()), False)]
            for values, custom in layers:
                default = values.pop("num_return_sequences", None)
                copies = default if copies is None else copies
                gc.update(**values, defaults_only=True, allow_custom_entries=custom)
        except (TypeError, AttributeError) as exc:  # transformers' own checks, on a value of the wrong type
            raise ValueError(f"generation_config holds a value of the wrong type ({exc})") from None
        gc.num_return_sequences = copies
        return gc

    @classmethod
    def from_generation_config(
        cls, config: GenerationConfig, prompt_len: int, model_config: GenerationConfig | None = None
    ) -> SamplingParams:
        """Resolve ``config`` the way ``model.generate`` does (user > model's generation config > global defaults).

        ``max_new_tokens`` falls back to ``max_length - prompt_len`` (at least 1). A seed may be set as a custom
        attribute (``GenerationConfig(seed=0)``); logprobs with ``output_logprobs=True`` or ``output_scores=True``;
        ``top_logprobs``, ``prompt_logprobs`` and ``json_schema`` are custom attributes too.
        """
        return cls.from_resolved(cls.resolve(config, model_config), prompt_len)

    @classmethod
    def from_resolved(cls, gc: GenerationConfig, prompt_len: int) -> SamplingParams:
        """The settings of a prompt of ``prompt_len`` tokens under ``gc``, a config from :meth:`resolve`.

        ``max_new_tokens`` falls back to ``max_length - prompt_len`` (at least 1). A seed may be set as a custom
        attribute (``GenerationConfig(seed=0)``); logprobs with ``output_logprobs=True`` or ``output_scores=True``;
        ``top_logprobs``, ``prompt_logprobs`` and ``json_schema`` are custom attributes too.
        """
        got = _typed(gc)
        max_new = got.get("max_new_tokens", max(1, (got.get("max_length") or 20) - prompt_len))
        min_new = got.get("min_new_tokens", max(0, (got.get("min_length") or 0) - prompt_len))
        if got.get("num_beams", 1) != 1:
            raise ValueError("beam search (num_beams > 1) is not served by the engine; use model.generate with a "
                             f"PagedAttentionCache for beam search (got num_beams={got['num_beams']})")
        logprobs = got.get("output_logprobs", False) or got.get("output_scores", False) or bool(got.get("top_logprobs"))
        return cls(max_new_tokens=max_new, min_new_tokens=min_new, eos_token_ids=eos_tuple(gc.eos_token_id),
                   stop_strings=_stop_tuple(gc.stop_strings), logprobs=logprobs,
                   json_schema=_schema_text(getattr(gc, "json_schema", None)),
                   **{name: got[name] for name in _AS_GIVEN if name in got})  # (unset ones keep the class's defaults)


def _schema_text(schema) -> str | None:
    """A JSON schema given as a dict or as JSON text, as JSON text (hashable, as the params must be)."""
    if schema is None or isinstance(schema, str):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON schema (a dict or its JSON text), got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)  # (key order kept: the grammar writes properties in it)


def eos_tuple(eos) -> tuple[int, ...]:
    """``eos_token_id`` (None, an integer, or a list, tuple, array or tensor of them) as a tuple of ints."""
    items = eos.tolist() if hasattr(eos, "tolist") else eos
    if items is None:
        return ()
    if isinstance(items, numbers.Integral):
        items = [items]
    if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):  # (a dict iterates its keys)
        raise ValueError(f"eos_token_id must be an integer or a list of integers, got {eos!r}")
    return tuple(_as(e, "eos_token_id") for e in items)


#: GenerationConfig settings that change which tokens ``model.generate`` picks but that the engine does not apply,
#: with the value that means off: a request setting one is refused rather than served with other tokens.
UNSERVED = {
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "force_words_ids": None, "constraints": None, "sequence_bias": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": 1.0,
    "penalty_alpha": None, "num_beam_groups": 1, "diversity_penalty": 0.0, "dola_layers": None,
    "watermarking_config": None, "max_time": None,
}



def _stop_tuple(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop_strings must be a string or a list of strings, got {type(stop).__name__}")
    return tuple(stop)


#: The settings read from a GenerationConfig, by the type they must have (None: unset). The integers are those of
#: ``_INT_RANGES`` and three without a range of their own: the lengths give the token counts, num_beams above 1 is
#: refused.
_INTS = (*_INT_RANGES, "max_length", "min_length", "num_beams")
_REALS = ("temperature", "top_p", "min_p", "repetition_penalty")
_BOOLS = ("do_sample", "output_logprobs", "output_scores")
#: Those that are ``SamplingParams`` fields of the same name and meaning.
_AS_GIVEN = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
             "num_return_sequences", "top_logprobs", "prompt_logprobs")


def _typed(config: GenerationConfig) -> dict:
    """The settings of ``_INTS``, ``_REALS`` and ``_BOOLS`` that ``config`` sets (not None), each checked and
    converted to its type."""
    return {name: _as(value, name) for name in _INTS + _REALS + _BOOLS
            if (value := getattr(config, name, None)) is not None}


def _as(value, name: str) -> int | float | bool:
    """``value`` of the setting ``name`` as a Python bool (``_BOOLS``), float (``_REALS``) or int (any other): numpy
    scalars are taken; a bool is no number, and nothing but a bool is one (``"no"`` is not False). The range checks
    come in ``__post_init__``."""
    kind, python_type, what = ((bool, bool, "True or False") if name in _BOOLS else
                               (numbers.Real, float, "a number") if name in _REALS else
                               (numbers.Integral, int, "an integer"))
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):  # (to Python a bool is an int)
        bounds = f" in {_INT_RANGES[name][2]}" if name in _INT_RANGES else ""
        raise ValueError(f"{name} must be {what}{bounds}, got {value!r}")
    return python_type(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(name: str, value, field: str | None = None) -> None:
    """Refuse ``value`` of the integer setting ``name`` outside its ``_INT_RANGES`` entry (None where the range
    allows it); the error names ``field`` (default: ``name``)."""
    low, high, bounds = _INT_RANGES[name]
    _check((value is None and "None" in bounds) or (_is_int(value) and low <= value <= high),
           f"{field or name} must be an integer in {bounds}, got {value!r}")


def checked_seed(value, field: str) -> int | None:
    """``value`` as a seed: None, or an integer that ``torch.Generator.manual_seed`` takes as it is (negative ones
    it wraps around, larger ones it refuses)."""
    value = value if value is None or isinstance(value, bool) or not isinstance(value, numbers.Integral) else int(value)
    _in_range("seed", value, field)
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
