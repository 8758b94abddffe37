"""Deadlines for reading a request, so that idle and slow clients cannot hold connections forever.

uvicorn times out only an idle kept-alive connection after a reply. `TimedH11Protocol` (uvicorn's
HTTP/1.1 protocol with two deadlines) also closes a connection that

- has not sent a request's whole head (request line and headers) within `header_timeout_s` of
  connecting or of its last reply: an idle connection, or a client sending its headers a byte at a time;
- has not sent the whole body within `body_timeout_s` of its head: a slow or stalled body.

While the app works on a complete request (a long generation, a stream) no deadline runs. A request
that is not valid HTTP/1.1 (a garbled request line or header, a bad Content-Length or chunk) is answered
400 with the API's JSON error body, code `invalid_http`, like every other refusal. Use it with
`uvicorn.Config(app, http=timed_protocol(header_timeout_s, body_timeout_s))`.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshlm.serve.api.errors import APIError

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's head and one for its body."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._deadline = None
        self._waiting_for = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as JSON rather than plain text."""
        body = json.dumps(
            APIError(
                400,
                "the request is not valid HTTP/1.1 (its request line, a header, its "
                "Content-Length or a chunk); send a well-formed HTTP/1.1 request",
                code="invalid_http",
            ).body()
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a reply had already begun: there is nothing left to say
            pass
        self.transport.close()

    def _watch(self) -> None:
        """Arm the deadline for what the connection waits for now: a head, a body, or nothing."""
        state = self.conn.their_state
        if state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            waiting = "head"
        elif state is h11.SEND_BODY:  # also after an early answer (413): the rest must come in time too
            waiting = "body"
        else:
            waiting = None
        if waiting != self._waiting_for:
            self._waiting_for = waiting
            self._arm({"head": self.header_timeout_s, "body": self.body_timeout_s}.get(waiting))

    def _arm(self, seconds: float | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if seconds is not None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request %s in time", self._waiting_for)
            self.transport.close()


def timed_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S) -> type:
    """A `TimedH11Protocol` class with these deadlines, for `uvicorn.Config(http=...)`."""
    return type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


__all__ = ["TimedH11Protocol", "timed_protocol", "HEADER_TIMEOUT_S", "BODY_TIMEOUT_S"]
