"""The HTTP API's gatekeepers, plain ASGI so that both act before a request body is read or parsed.

`RequireApiKey`: `/v1/*` only with `Authorization: Bearer <api_key>` (401 otherwise); the chat page
and /health stay open. `LimitBody`: 413 for a request body over the limit.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.serve.api_errors import APIError


class RequireApiKey:
    """`/v1/*` only with `Authorization: Bearer <api_key>`; the page and /health stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class LimitBody:
    """413 for a body over `limit` bytes, whether announced by Content-Length or found while reading.

    The rest of an oversized body is read and dropped before answering (up to `_DRAIN_LIMIT`): a server
    that answers and closes while the client is still sending resets the connection, and the client
    then sees a broken pipe instead of the 413.
    """

    _DRAIN_LIMIT = 64 << 20

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._drain(receive)
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
                    if message.get("more_body"):
                        await self._drain(receive)
                    raise BodyTooLarge(self.limit)  # an HTTPException, so the app answers it
            return message

        await self.app(scope, receive_within_limit, send)

    async def _drain(self, receive: Receive) -> None:
        drained = 0
        while drained < self._DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return
            drained += len(message.get("body", b""))


__all__ = ["RequireApiKey", "LimitBody", "BodyTooLarge"]
