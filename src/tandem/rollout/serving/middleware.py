"""``GuardMiddleware``: the checks every request passes before routing (which key its path
wants, whether its path is served, body size).

Plain ASGI, so a refused request costs no parsing and an oversized body is never held whole.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping
from typing import Any

from .errors import APIError


class GuardMiddleware:
    """Refuses a request before routing: no or a wrong key for its path (401), the inference
    key on a control route (403), a control route not served (404, naming the option that
    serves it), or a body over the limit (413). It reads the (bounded) body itself and
    replays it.

    Args:
        app: the application behind the guard.
        api_key: the key every path but the open and control ones wants (None: none).
        max_body_bytes: the largest body taken.
        open_paths: the paths no key guards.
        control_api_key: the key the control paths want (None: the API key).
        control_paths: the served routes that control the engine (the control and
            weight-transfer groups).
        unserved_paths: the control routes not served, each with the option that serves it.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 open_paths: frozenset[str] = frozenset({"/health"}),
                 control_api_key: str | None = None,
                 control_paths: frozenset[str] = frozenset(),
                 unserved_paths: Mapping[str, str] | None = None) -> None:
        self.app = app
        self.expected = _bearer(api_key)
        self.control_expected = _bearer(control_api_key) or self.expected
        self.open_paths = open_paths
        self.control_paths = control_paths
        self.unserved_paths = unserved_paths or {}
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Check one HTTP request, then pass it on with its body replayed."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope["path"], dict(scope["headers"]).get(b"authorization",
                                                                          b""))
        if refusal is not None:
            return await _send_error(send, refusal)
        body = await self._read_body(scope, receive)
        if body is None:
            return await _send_error(send, APIError(
                413, f"the request body exceeds {self.max_body_bytes} bytes "
                "(--max-body-bytes).", code="request_too_large"))
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay_receive() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    def _refusal(self, path: str, given: bytes) -> APIError | None:
        """Why a request for ``path`` with the ``Authorization`` header ``given`` is refused
        before routing, or None."""
        if path in self.open_paths:
            return None
        if path in self.control_paths:
            return self._control_refusal(given)
        if not _matches(given, self.expected):
            return APIError(401, "missing or wrong API key: send 'Authorization: Bearer "
                            "<key>' with the key the server was started with (--api-key).",
                            code="invalid_api_key")
        option = self.unserved_paths.get(path)
        if option is not None:
            return APIError(404, f"{path} is not served: it controls the engine, so it is off "
                            f"unless the server is started with {option} (see "
                            "--control-api-key).", code="route_not_served")
        return None

    def _control_refusal(self, given: bytes) -> APIError | None:
        if _matches(given, self.control_expected):
            return None
        if self.control_expected != self.expected and self.expected is not None \
                and hmac.compare_digest(given, self.expected):
            return APIError(403, "this route controls the engine: it wants the control key "
                            "(the server's --control-api-key, the trainer's), not the "
                            "inference key (--api-key).", code="control_key_required")
        return APIError(401, "missing or wrong control key: send 'Authorization: Bearer "
                        "<key>' with the server's --control-api-key (or its --api-key when it "
                        "has no control key).", code="invalid_api_key")

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


def _bearer(key: str | None) -> bytes | None:
    return None if key is None else f"Bearer {key}".encode()


def _matches(given: bytes, expected: bytes | None) -> bool:
    """Whether ``given`` is the ``expected`` header (anything when None), in constant time."""
    return expected is None or hmac.compare_digest(given, expected)


async def _send_error(send: Callable, error: APIError) -> None:
    payload = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
