"""Running the HTTP API: the listening socket, the uvicorn server, its shutdown and the signals.

The socket is bound before the model loads and compiles (`bind`), so a busy port fails at once. At
SIGINT/SIGTERM the server stops accepting connections, lets open replies run for a grace period,
then ends them with 503 "shutting down" (a stream: an error event) rather than a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from meshlm.errors import UsageError
from meshlm.serve.api.routes import create_app
from meshlm.serve.api.timeouts import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, timed_protocol
from meshlm.serve.engine.batching import Engine

log = logging.getLogger("meshlm.serve.api")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening. Taken before the model loads and compiles, so
    that a busy port or an unknown host fails at once (UsageError) rather than after minutes of work."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise UsageError(f"--host={host}: not an address this machine can bind ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(
                f"--host={host} is not an address of this machine; use 127.0.0.1 (this machine "
                "only) or 0.0.0.0 (every interface)"
            ) from None
        raise UsageError(
            f"--host={host} --port={port}: cannot listen there ({e.strerror}); "
            "choose another --port or stop what holds it"
        ) from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown gives the replies still running `grace_s` seconds to finish and
    then ends them properly (503, or an error event closing the stream) instead of cutting them off."""

    def __init__(self, config: uvicorn.Config, end_open_requests: Callable[[], None], grace_s: float):
        super().__init__(config)
        self._end_open_requests, self._grace_s = end_open_requests, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        async def end_after_grace() -> None:
            await asyncio.sleep(self._grace_s)
            log.info("ending the replies still running after %.0f s", self._grace_s)
            self._end_open_requests()

        ender = asyncio.ensure_future(end_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()


def make_server(
    app: FastAPI,
    *,
    grace_s: float = 5.0,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
    **config: Any,
) -> uvicorn.Server:
    """A uvicorn server for an app from `create_app`; `config` goes to `uvicorn.Config`.

    Run it with `server.run(sockets=[bind(host, port)])`. At SIGINT/SIGTERM it stops accepting
    connections, lets open replies run for `grace_s` seconds, then ends them with 503 "shutting down".
    A connection that sends no complete request head within `header_timeout_s` (idle, or headers
    trickling in) or no complete body within `body_timeout_s` of its head is closed
    (meshlm/serve/api/timeouts.py); a kept-alive connection idle for 5 s after a reply too.
    """
    # uvicorn's own cut-off is only a backstop: ended replies close within a decode step.
    config.setdefault("http", timed_protocol(header_timeout_s, body_timeout_s))
    config.setdefault("timeout_keep_alive", 5)
    config = uvicorn.Config(app, timeout_graceful_shutdown=grace_s + 5, **config)
    return _Server(config, app.state.end_open_requests, grace_s)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    sock: socket.socket | None = None,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> None:
    """Serve `engine` over HTTP until SIGINT or SIGTERM. The engine is the caller's to start and stop.

    `sock`, from `bind(host, port)`, is used instead of binding here; the timeouts are `make_server`'s."""
    sock = sock or bind(host, port)
    server = make_server(
        create_app(engine, api_key=api_key),
        host=host,
        port=port,
        log_level=log_level,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
    )
    # What is alive now (weights, compiled programs, modules) lives as long as the server: frozen out of
    # the cyclic collector, a full collection no longer walks it, and so no longer stalls the token loop.
    gc.freeze()
    try:
        with _signal_handled_by_server():
            server.run(sockets=[sock])
    finally:
        sock.close()


@contextlib.contextmanager
def _signal_handled_by_server():
    """uvicorn shuts down on SIGINT/SIGTERM and, once done, raises the signal again for the handler it
    found; that must not kill the process (SIGTERM) or interrupt it (SIGINT) before the caller stops
    the engine (and, across processes, the others): the server's shutdown has already answered it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda *_: None) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = ["bind", "make_server", "serve"]
