"""Schemathesis hooks for tests/test_schemathesis.py (loaded through ``SCHEMATHESIS_HOOKS``)."""

from __future__ import annotations

import os
from typing import Any

import schemathesis


@schemathesis.hook
def before_load_schema(context: Any, raw_schema: dict[str, Any]) -> None:
    """Leave Tandem's ``timeout`` extension out of generated bodies: a deadline shorter than
    the work is answered 504 by design (tests/test_server_limits.py pins it), which the
    server-error check would count as a failure. And name the served model."""
    for schema in raw_schema.get("components", {}).get("schemas", {}).values():
        properties = schema.get("properties", {})
        properties.pop("timeout", None)
        if "model" in properties:
            properties["model"] = served_model()


def served_model() -> dict[str, Any]:
    """The ``model`` field's schema as the test's server takes it: its served name or null
    (a random name gets a 404 by design, so almost no request would reach generation)."""
    return {"anyOf": [{"const": os.environ["TANDEM_SERVED_MODEL"]}, {"type": "null"}]}
