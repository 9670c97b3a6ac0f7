"""Checks at the door: what a request carries is validated completely before it is queued.

A value the engine cannot serve raises ``ValueError`` with one line saying what to pass instead, and nothing is
queued; no value that passes can make a later step fail (the sampling settings are checked by ``SamplingParams``).
"""

from __future__ import annotations

import numbers

from transformers import GenerationConfig

from hf_paged.hf._support import position_limit  # noqa: F401  (the engine reads it here too)

CHILD_MARK = "__child#"  # copies of num_return_sequences are named "<id>__child#<k>", as in transformers


def prompt_token_ids(prompt, vocab_size: int, tokenizer=None, field: str = "prompt") -> list[int]:
    """``prompt`` (a string, or one sequence of token ids: list, tuple, 1-D tensor or array) as a list of ints in
    ``[0, vocab_size)``. Numpy and torch integers are taken; bools, floats and nested lists are refused. A string
    must be well-formed text (:func:`text`); a tokenizer that cannot encode it is a ``ValueError`` too. ``field``
    names the prompt in the errors (``prompts[3]``)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: create the Engine with tokenizer=..., or pass ids")
        prompt = text(prompt, field)
        try:
            prompt = tokenizer.encode(prompt)
        except Exception as exc:  # (a tokenizer's own refusal of this text is bad input, not an engine fault)
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(f"{field}: the tokenizer cannot encode it ({type(exc).__name__}: {first_line})") from exc
    if hasattr(prompt, "tolist") and hasattr(prompt, "ndim"):
        if prompt.ndim != 1:
            raise ValueError(f"a prompt is one sequence of token ids, got an array of shape {tuple(prompt.shape)} "
                             "(for a [1, n] tensor pass ids[0])")
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple, range)):
        ids = list(prompt)
    else:
        raise ValueError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    if not set(map(type, ids)) <= {int}:  # (bools, numpy and torch scalars are other types)
        ids = [_token_id(t, vocab_size) for t in ids]
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad}")
    return ids


def text(value, field: str) -> str:
    """``value`` as a plain ``str`` that UTF-8 can encode; else ``ValueError`` naming ``field``. A lone surrogate
    (half of a UTF-16 pair: JSON's ``"\\ud800"``, a split emoji from a JavaScript client) is the one thing a Python
    string can hold that text encoders refuse."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {type(value).__name__}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{field} is not valid Unicode text: a lone surrogate U+{ord(value[exc.start]):04X} at "
                             f"character {exc.start} (half of a UTF-16 pair); send whole characters") from None
    return str(value)  # (a str subclass as the plain str)


def _token_id(value, vocab_size: int) -> int:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy and torch scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {value!r} "
                         f"({type(value).__name__})")
    return int(value)


def prompt_list(prompts, what: str = "generate") -> list:
    """The prompts of ``what``: a list (or tuple, or 2-D array) of prompts, never one prompt alone."""
    if hasattr(prompts, "ndim") and hasattr(prompts, "tolist") and prompts.ndim == 2:
        return list(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"{what} takes a list of prompts (strings or token-id lists), got "
                         f"{type(prompts).__name__}: wrap one prompt in a list")
    if any(isinstance(p, numbers.Integral) for p in prompts):
        raise ValueError(f"{what} takes a list of prompts, got one list of token ids: pass [[5, 6, 7]] for the "
                         "single prompt [5, 6, 7]")
    return list(prompts)


def generation_config(config) -> GenerationConfig | None:
    """``config`` if it is a ``GenerationConfig`` or None; anything else (a dict, keyword settings) is refused."""
    if config is None or isinstance(config, GenerationConfig):
        return config
    hint = ": pass GenerationConfig(**settings)" if isinstance(config, dict) else ""
    raise ValueError(f"generation_config must be a transformers.GenerationConfig or None, got {type(config).__name__}"
                     f"{hint}")


def generation_configs(config, num_prompts: int) -> list[GenerationConfig | None]:
    """One config for every prompt, or a list of one per prompt."""
    configs = list(config) if isinstance(config, (list, tuple)) else [config] * num_prompts
    if len(configs) != num_prompts:
        raise ValueError(f"got {len(configs)} generation configs for {num_prompts} prompts; give one or one each")
    return [generation_config(c) for c in configs]


def request_id(value) -> str | None:
    """A user's request id as a string (ints are taken: ``abort(7)`` finds ``add_request(..., request_id=7)``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise ValueError(f"request_id must be a string or an integer, got {type(value).__name__}")
    rid = str(int(value)) if isinstance(value, numbers.Integral) else text(value, "request_id")
    if not rid or CHILD_MARK in rid:
        raise ValueError(f"request_id {rid!r} is empty or contains {CHILD_MARK!r} (reserved for the copies of "
                         "num_return_sequences); pick another")
    return rid
