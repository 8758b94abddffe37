"""Deadlines for reading a request, so that idle and slow clients cannot hold connections forever.

uvicorn times out only an idle kept-alive connection after a reply. `TimedH11Protocol` (uvicorn's
HTTP/1.1 protocol with two deadlines) also closes a connection that

- has not sent a request's whole head (request line and headers) within `header_timeout_s` of
  connecting or of its last reply: an idle connection, or a client sending its headers a byte at a time;
- has not sent the whole body within `body_timeout_s` of its head: a slow or stalled body.

While the app works on a complete request (a long generation, a stream) no deadline runs. Use it with
`uvicorn.Config(app, http=timed_protocol(header_timeout_s, body_timeout_s))`.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

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
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


__all__ = ["TimedH11Protocol", "timed_protocol", "HEADER_TIMEOUT_S", "BODY_TIMEOUT_S"]
