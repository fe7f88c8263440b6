"""ASGI middleware of the app: the /v1 gate (API key, draining) and the X-Request-Id echo. Pure
ASGI, so that neither ever buffers a stream."""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from starlette.responses import Response

from gemma4serve.server.protocol import error_body
from gemma4serve.server.responses import json_response

if TYPE_CHECKING:
    from gemma4serve.server.state import ServerState

MAX_REQUEST_ID_CHARS = 256  # a longer X-Request-Id is replaced by a generated one


class ApiGate:
    """Refuses /v1 requests without the API key (401) or while the server cannot take work (503)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self._keys = [_digest(key.encode()) for key in state.settings.api_keys]

    async def __call__(self, scope, receive, send):
        # A CORS preflight (OPTIONS) carries no credentials: CORSMiddleware answers it before this.
        if scope["type"] == "http" and _route_path(scope).startswith("/v1"):
            if scope["method"] == "OPTIONS":
                await self.app(scope, receive, send)
                return
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Response | None:
        if self._keys:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            # Digests of equal length, every key compared: the time taken tells nothing of a key.
            given = _digest(token.strip())
            matches = [hmac.compare_digest(given, key) for key in self._keys]
            if scheme.lower() != b"bearer" or not any(matches):
                message = (
                    "Incorrect API key provided." if auth else "You didn't provide an API key."
                )
                return json_response(
                    401, error_body(message, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"}
                )
        unavailable = self.state.unavailable()
        if unavailable:
            return json_response(503, error_body(unavailable, type="service_unavailable"))
        return None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _route_path(scope) -> str:
    """The path the routes see: behind --root-path, uvicorn puts the prefix in front of it."""
    root = scope.get("root_path", "")
    path = scope["path"]
    return path[len(root) :] if root and path.startswith(root) else path


def given_request_id(scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value if 0 < len(value) <= MAX_REQUEST_ID_CHARS else None
    return None


class RequestIdHeader:
    """Echoes a request's X-Request-Id header in its response, as vLLM does (generation
    responses send their request id whether or not one was given)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        given = given_request_id(scope) if scope["type"] == "http" else None
        if given is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() != b"x-request-id"
                ]
                message = {**message, "headers": headers + [(b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
