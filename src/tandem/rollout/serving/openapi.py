"""The served OpenAPI schema (``/openapi.json``), made to say what the server answers.

FastAPI documents a failed validation as its 422 with its own body; this server answers
OpenAI's 400 with OpenAI's error body (errors.py). ``install_openapi`` rewrites the
generated schema once: every operation that validates anything lists 400 with
``ErrorResponse`` instead of 422, every operation taking a body lists 413 (the guard's body
limit), and every guarded operation names its security scheme (``APIKey``, or
``ControlKey`` for the served routes that control the engine) and lists 401, a control
route 403 too (the inference key where the control key is wanted). The control routes not
served are not routes, so they are not in it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from fastapi import FastAPI

from .errors import ERROR_DESCRIPTIONS, ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


SECURITY_SCHEMES = {
    "APIKey": {"type": "http", "scheme": "bearer", "description": (
        "--api-key: every route but /health, /metrics and the control routes.")},
    "ControlKey": {"type": "http", "scheme": "bearer", "description": (
        "--control-api-key: the routes that control the engine (sleep, pause, weight "
        "transfer), the trainer's.")},
}
CONTROL_403 = ("A route that controls the engine called with the inference key, not the "
               "control key; or a weight-transfer trainer host not allowed.")


def install_openapi(app: FastAPI, guarded: bool, open_paths: Collection[str],
                    control_paths: Collection[str] = frozenset(),
                    control_guarded: bool = False) -> None:
    """Have ``app`` serve the corrected schema (built on the first request for it).

    Args:
        app: the application, all routes included.
        guarded: True when the server wants an API key.
        open_paths: the paths no key guards.
        control_paths: the served routes that control the engine.
        control_guarded: True when they want a control key of their own.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # generate() caches it on the app
            corrected(generate(), guarded, open_paths, control_paths, control_guarded)
        return app.openapi_schema

    app.openapi = openapi


def corrected(schema: dict[str, Any], guarded: bool, open_paths: Collection[str],
              control_paths: Collection[str] = frozenset(),
              control_guarded: bool = False) -> None:
    """Rewrite FastAPI's ``schema`` in place: 400 for 422, 413 for bodies, and each guarded
    operation's security scheme with 401 (and 403 on a control route)."""
    schemes = set()
    for path, operation in _operations(schema):
        responses = operation["responses"]
        if responses.pop("422", None) is not None:
            responses.setdefault("400", _error_response(400))
        if "requestBody" in operation:
            responses.setdefault("413", _error_response(413))
        if path in control_paths:
            responses.setdefault("403", _error_response(403, CONTROL_403))
        scheme = _scheme(path, guarded, open_paths, control_paths, control_guarded)
        if scheme is not None:
            operation["security"] = [{scheme: []}]
            responses.setdefault("401", _error_response(401))
            schemes.add(scheme)
    if schemes:
        schema.setdefault("components", {})["securitySchemes"] = {
            name: SECURITY_SCHEMES[name] for name in sorted(schemes)}
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


def _scheme(path: str, guarded: bool, open_paths: Collection[str],
            control_paths: Collection[str], control_guarded: bool) -> str | None:
    """The security scheme the guard wants on ``path`` (None: no key)."""
    if path in control_paths and control_guarded:
        return "ControlKey"
    return "APIKey" if guarded and path not in open_paths else None


def _error_response(status: int, description: str | None = None) -> dict[str, Any]:
    return {"description": description or ERROR_DESCRIPTIONS[status], "content": {
        "application/json": {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}}
