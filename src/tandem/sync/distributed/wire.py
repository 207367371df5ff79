"""Strict reading of the JSON the store carries (headers, layouts, CUDA IPC handles).

Whoever can reach the store can write these bytes, so nothing read from it is unpickled or
looked up by name: every value is decoded as JSON and checked for its key and type here
before the sender's and receiver's code uses it.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any


def parse_json(payload: str | bytes, what: str) -> Any:
    """``payload`` decoded as JSON.

    Raises:
        ValueError: naming ``what`` when it is not UTF-8 JSON.
    """
    try:
        return json.loads(payload)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise ValueError(f"{what} is not JSON ({exc})") from exc


def expect(value: Any, kind: type, what: str) -> Any:
    """``value`` when it is exactly of ``kind`` (an ``int`` is never a ``bool``) and, for an
    ``int``, not negative.

    Raises:
        ValueError: naming ``what``, the type wanted and the value found.
    """
    if type(value) is not kind:
        raise ValueError(f"{what} must be {_KIND_NAMES.get(kind, kind.__name__)}, got "
                         f"{_shown(value)}")
    if kind is int and value < 0:
        raise ValueError(f"{what} must not be negative, got {value}")
    return value


def expect_list(value: Any, length: int, what: str) -> list[Any]:
    """``value`` when it is a JSON list of ``length`` items.

    Raises:
        ValueError: naming ``what`` for anything else.
    """
    if len(expect(value, list, what)) != length:
        raise ValueError(f"{what} must hold {length} items, got {len(value)}")
    return value


def expect_keys(fields: Any, keys: set[str], what: str) -> dict[str, Any]:
    """``fields`` when it is a JSON object with exactly ``keys``.

    Raises:
        ValueError: naming ``what`` and the keys missing or unexpected.
    """
    fields = expect(fields, dict, what)
    missing, unexpected = sorted(keys - fields.keys()), sorted(fields.keys() - keys)
    if missing or unexpected:
        raise ValueError(f"{what} has the wrong keys (missing {missing}, unexpected "
                         f"{unexpected})")
    return fields


def encode_bytes(value: bytes) -> str:
    """``value`` as base64 text, for JSON."""
    return base64.b64encode(value).decode("ascii")


def decode_bytes(value: Any, what: str) -> bytes:
    """The bytes ``encode_bytes`` wrote.

    Raises:
        ValueError: naming ``what`` when it is not base64 text.
    """
    try:
        return base64.b64decode(expect(value, str, what), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{what} is not base64 ({exc})") from exc


_KIND_NAMES = {int: "an integer", bool: "a boolean", str: "a string", list: "a list",
               dict: "an object"}


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
