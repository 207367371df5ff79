"""What a refused request gets: OpenAI's error body, and which status each failure maps to.

``APIError`` is a refusal the server decides itself (a model it does not serve, a limit
passed); ``add_error_handlers`` answers every other exception a route lets out: a body that
fails validation or a ``ValueError`` is 400, a weight update the engine refuses 400, an
engine or weight transfer in the wrong state 409, anything else 500.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.sync import WeightUpdateError

from ..errors import EngineAsleepError
from .weight_transfer import WeightTransferStateError


def error_body(message: str, error_type: str = "invalid_request_error",
               param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class APIError(Exception):
    """A request the server refuses, answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, error_type, param, code)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every exception a route raises with a status and OpenAI's error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ValueError, _answering(400))
    app.add_exception_handler(WeightUpdateError, _answering(400, "weight_update_error"))
    for state_error in (EngineAsleepError, WeightTransferStateError):
        app.add_exception_handler(state_error, _answering(409, "conflict"))
    app.add_exception_handler(Exception, _internal)


def _answer(status: int, message: str, error_type: str = "invalid_request_error",
            param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param), status_code=status)


def _answering(status: int, error_type: str = "invalid_request_error"
               ) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """A handler answering ``status`` with the exception's message."""
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return _answer(status, str(exc), error_type)

    return handler


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return _answer(400, f"the body is not valid JSON: "
                       f"{error.get('ctx', {}).get('error', error['msg'])}")
    # OpenAI's ``param`` names the request field; deeper parts of pydantic's location are
    # union members and list positions.
    param = str(error["loc"][1]) if len(error["loc"]) > 1 else None
    return _answer(400, f"{param or 'body'}: {error['msg']}", param=param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _answer(exc.status_code, str(exc.detail))


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    return _answer(500, f"internal error: {exc!r}", "internal_server_error")
