"""The served OpenAPI schema (``/openapi.json``), made to say what the server answers.

FastAPI documents a failed validation as its 422 with its own body; this server answers
OpenAI's 400 with OpenAI's error body (errors.py). ``install_openapi`` rewrites the
generated schema once: every operation that validates anything lists 400 with
``ErrorResponse`` instead of 422, every operation taking a body lists 413 (the guard's body
limit), and with an API key every guarded operation lists 401.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from fastapi import FastAPI

from .errors import ERROR_DESCRIPTIONS, ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def install_openapi(app: FastAPI, guarded: bool, open_paths: Collection[str]) -> None:
    """Have ``app`` serve the corrected schema (built on the first request for it).

    Args:
        app: the application, all routes included.
        guarded: True when the server wants an API key (then 401 is listed).
        open_paths: the paths the API key does not guard.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            corrected(generate(), guarded, open_paths)  # generate() caches it on the app
        return app.openapi_schema

    app.openapi = openapi


def corrected(schema: dict[str, Any], guarded: bool, open_paths: Collection[str]) -> None:
    """Rewrite FastAPI's ``schema`` in place: 400 for 422, 413 for bodies, 401 if guarded."""
    for path, operation in _operations(schema):
        responses = operation["responses"]
        if responses.pop("422", None) is not None:
            responses.setdefault("400", _error_response(400))
        if "requestBody" in operation:
            responses.setdefault("413", _error_response(413))
        if guarded and path not in open_paths:
            responses.setdefault("401", _error_response(401))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    error_schema = ErrorResponse.model_json_schema(ref_template=REF_TEMPLATE)
    components.update(error_schema.pop("$defs", {}))
    components.setdefault("ErrorResponse", error_schema)


def _operations(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in schema.get("paths", {}).items():
        for method in HTTP_METHODS:
            if method in item:
                yield path, item[method]


def _error_response(status: int) -> dict[str, Any]:
    return {"description": ERROR_DESCRIPTIONS[status], "content": {"application/json": {
        "schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}}
