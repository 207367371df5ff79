"""What a refused request gets: OpenAI's error body, and which status each failure maps to.

``APIError`` is a refusal the server decides itself (a model it does not serve, a limit
passed); ``add_error_handlers`` answers every other exception a route lets out: a body that
fails validation or a ``ValueError`` is 400, a weight update the engine refuses 400, an
engine or weight transfer in the wrong state 409, a request refused for now (overload,
shutdown) or a dead engine core process 503 (with ``Retry-After`` when retrying helps), a
request past its deadline or a weight-transfer group that did not form in time 504,
anything else 500. ``ErrorResponse`` is the body's model, for the OpenAPI schema.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.sync import WeightUpdateError

from ..errors import EngineAsleepError
from .admission import RequestTimeoutError, ServerUnavailableError
from .core_client import EngineDeadError
from .weight_transfer import WeightTransferStateError, WeightTransferTimeoutError

ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field fails validation, or a value passes a limit.",
    401: "Missing or wrong API key.",
    404: "Unknown route, or a model this server does not serve.",
    409: "The engine is asleep, or a weight-transfer call is out of order.",
    413: "The request body is over --max-body-bytes.",
    503: "Overloaded (--max-num-waiting; see Retry-After), shutting down, or the engine core "
         "process died.",
    504: "The request passed its deadline (--request-timeout or its timeout) and was "
         "aborted, or no trainer's weight-transfer group formed within "
         "--weight-transfer-timeout.",
}


class ErrorDetail(BaseModel):
    """OpenAI's error: what went wrong, its kind, the request field it concerns, a code."""

    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for ``statuses``, each with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
            for status in statuses}


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
    app.add_exception_handler(ServerUnavailableError, _unavailable)
    app.add_exception_handler(EngineDeadError, _answering(503, "service_unavailable"))
    app.add_exception_handler(RequestTimeoutError, _answering(504, "timeout"))
    app.add_exception_handler(WeightTransferTimeoutError, _answering(504, "timeout"))
    app.add_exception_handler(Exception, _internal)


def stream_error(exc: Exception) -> dict[str, Any]:
    """The error event ending a stream that has begun (vLLM's: the status as the code)."""
    if isinstance(exc, RequestTimeoutError):
        return error_body(str(exc), "timeout", code=504)
    if isinstance(exc, EngineDeadError):
        return error_body(str(exc), "service_unavailable", code=503)
    return error_body(str(exc), "internal_server_error", code=500)


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


async def _unavailable(_: Request, exc: ServerUnavailableError) -> JSONResponse:
    headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
    return JSONResponse(error_body(str(exc), "service_unavailable"), status_code=503,
                        headers=headers)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    response = _answer(exc.status_code, str(exc.detail))
    response.headers.update(exc.headers or {})  # e.g. the Allow of a 405
    return response


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    return _answer(500, f"internal error: {exc!r}", "internal_server_error")
