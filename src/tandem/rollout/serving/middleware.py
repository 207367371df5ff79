"""``GuardMiddleware``: the checks every request passes before routing (API key, body size).

Plain ASGI, so a refused request costs no parsing and an oversized body is never held whole.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from .errors import APIError


class GuardMiddleware:
    """Refuses a request before routing: no or a wrong API key (401; ``open_paths`` need
    none) or a body over the limit (413). It reads the (bounded) body itself and replays
    it."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 open_paths: frozenset[str] = frozenset({"/health"})) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.open_paths = open_paths
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Check one HTTP request, then pass it on with its body replayed."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] not in self.open_paths and not self._authorized(scope):
            return await _send_error(send, APIError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                "key the server was started with (--api-key).", code="invalid_api_key"))
        body = await self._read_body(scope, receive)
        if body is None:
            return await _send_error(send, APIError(
                413, f"the request body exceeds {self.max_body_bytes} bytes "
                "(--max-body-bytes).", code="request_too_large"))
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay_receive() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    def _authorized(self, scope: dict) -> bool:
        if self.expected is None:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | None:
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            more = message.get("more_body", False)
        return bytes(body)


async def _send_error(send: Callable, error: APIError) -> None:
    payload = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
