"""A request body at the door: bytes to a checked pydantic model, or a 400 naming what is wrong.

The body must be UTF-8 JSON (an object), nested at most ``MAX_DEPTH`` levels, and every string in it (keys too) valid
Unicode: JSON can carry an unpaired surrogate escape (``"\\ud800"``, half of a split emoji), which no tokenizer can
encode. Then the fields' types are checked (:mod:`hf_paged.server._protocol`); an error's ``param`` names the field
as the client wrote it (``messages.0.content``), never pydantic's internals. The size of the body is bounded before
it is read (:mod:`hf_paged.server._access`); this work runs off the event loop (the routes call it in a thread).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from hf_paged.engine import _validation as validation
from hf_paged.server._errors import ServerError, bad_request
from hf_paged.server._protocol import FIELD_NAMES

MAX_DEPTH = 64
_LEAVES = {int, float, bool, type(None)}
M = TypeVar("M", bound=BaseModel)


def parse(body: bytes, model: type[M]) -> M:
    """``body`` as a ``model``; raises a 400 ``ServerError`` saying what is wrong."""
    if not body.strip():
        raise bad_request("the body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not UTF-8 (byte {body[exc.start]:#04x} at offset {exc.start}); send JSON "
                          "encoded as UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:  # a constant (NaN), or an integer of thousands of digits
        raise bad_request(f"the body is not valid JSON: {str(exc).splitlines()[0]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {json_type(data)}", code="invalid_json")
    _check(data, "", 1)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None


def _check_text(text: str, path: str) -> None:
    """Refuse a string no UTF-8 encoder takes (an unpaired surrogate), as the engine does, naming ``path``."""
    try:
        validation.text(text, path or "a string of the body")
    except ValueError as exc:
        raise bad_request(str(exc), path or None, "invalid_text") from None


def _check(value: Any, path: str, depth: int, exact: bool = True) -> None:
    """Walk ``value``; ``path`` names where it is, as far as the names are the request's own fields (``exact``): a
    key the models do not know ends the name there (it is no field, and may hold any text)."""
    if depth > MAX_DEPTH:
        raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    kind = type(value)
    if kind is str:
        _check_text(value, path)
    elif kind is dict:
        for key, item in value.items():
            _check_text(key, path)
            known = exact and key in FIELD_NAMES
            _check(item, (f"{path}.{key}" if path else key) if known else path, depth + 1, known)
    elif kind is list and not set(map(type, value)) <= _LEAVES:
        for i, item in enumerate(value):
            _check(item, f"{path}.{i}" if exact else path, depth + 1, exact)


def _from_validation_error(exc: ValidationError) -> ServerError:
    first = next(iter(exc.errors(include_url=False)), {})
    param = ".".join(str(p) for p in first.get("loc", ()) if isinstance(p, int) or p in FIELD_NAMES) or None
    kind = first.get("type", "invalid")
    if kind == "missing":
        message = f"{param} is required"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if "input" in first and kind != "extra_forbidden":
            value = first["input"]
            got = json.dumps(value) if not isinstance(value, (dict, list)) else json_type(value)
            message += f", got {got if len(got) <= 40 else got[:37] + '...'}"
    return bad_request(message, param, kind)


def json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
