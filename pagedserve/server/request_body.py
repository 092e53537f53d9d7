"""What every request body shares: only known fields, only encodable text, finite numbers.

A top-level body (``RequestBody``) refuses fields it does not know (``extra="forbid"``): a
parameter that would change the output elsewhere is a 400 naming it, never silently
dropped. Nested objects stay lenient (``NestedBody``), because clients send back the
messages and blocks they received, with fields such as ``refusal`` or ``cache_control``
that carry no meaning here. Before any field is validated, the whole body is searched for
text that cannot be encoded as UTF-8 (lone surrogates such as ``"\\ud800"``, which JSON
escapes can carry): the first one found is a 400 naming its field. Floats must be finite
(JSON's ``NaN`` and ``Infinity`` extensions are refused).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pagedserve.server.errors import APIError

_LEAF_TYPES = frozenset((int, float, bool, type(None)))


def _bad_text(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unencodable(value: Any) -> str | None:
    """The path of a string (value or key) in ``value`` that is not valid Unicode text, or
    ``None``. Iterative, so no nesting depth can overflow the stack; a list of numbers
    (token ids) is passed over in C, so it costs milliseconds per million."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _bad_text(item):
                return where or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and _bad_text(key):
                    return where or "body"
                if type(child) not in _LEAF_TYPES:
                    stack.append((child, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list) and not set(map(type, item)) <= _LEAF_TYPES:
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item)
                         if type(child) not in _LEAF_TYPES)
    return None


def check_encodable(value: Any) -> None:
    """400 naming the first field of ``value`` whose text is not valid Unicode."""
    where = _unencodable(value)
    if where is not None:
        raise APIError(400, f"{where}: the text is not valid Unicode (it holds a lone "
                       "surrogate or another code point that UTF-8 cannot encode)",
                       param=where)


class NestedBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        check_encodable(data)
        return data
