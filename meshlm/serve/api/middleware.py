"""The HTTP API's gatekeepers, plain ASGI so that both act before a request body is read or parsed.

`RequireApiKey`: every route but the chat page and /health only with `Authorization: Bearer <api_key>`
(401 otherwise): `/v1/*`, `/docs` and `/openapi.json` too. `LimitBody`: 413 for a request body over the limit.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.serve.api.errors import APIError

OPEN_PATHS = ("/", "/health")  # with what is under /static/: the chat page asks for the key itself


class RequireApiKey:
    """Every route only with `Authorization: Bearer <api_key>` (the scheme's case does not matter, as
    HTTP has it), except the chat page (`/`, `/static/*`) and `/health`."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and not (path in OPEN_PATHS or path.startswith("/static/")):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            right_key = hmac.compare_digest(given.strip(), self.expected)
            if not (right_key and scheme.lower() == b"bearer"):
                error = APIError(
                    401,
                    "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                )
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class LimitBody:
    """413 for a body over `limit` bytes: at once when Content-Length announces it, and as soon as a
    body sent without one (chunked) goes past the limit. Nothing more of it is read into memory: the
    HTTP server discards what the client still sends after the answer."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = APIError(413, BodyTooLarge(self.limit).detail, code="request_too_large").response()
            await response(scope, receive, send)
            return

        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)  # an HTTPException, so the app answers it
            return message

        await self.app(scope, receive_within_limit, send)


__all__ = ["OPEN_PATHS", "RequireApiKey", "LimitBody", "BodyTooLarge"]
