"""A live server for the HTTP tests: uvicorn in a background thread on 127.0.0.1, a free port, and a
real engine on the tiny random `test` preset, compiled once per test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from meshlm.serve.api import create_app, make_server
from meshlm.serve.engine import Engine

MAX_SEQ_LEN = 256
MAX_BATCH = 8


@pytest.fixture(scope="session")
def engine():
    engine = Engine.for_testing(preset="test", mesh_dim="1,1,1,1", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    yield engine
    engine.stop()


@contextlib.contextmanager
def live_server(app, grace_s: float = 1.0) -> Iterator[str]:
    """Serves `app` (from `create_app`) until the block ends, as `meshlm serve` does; yields its base URL.
    Leaving the block shuts the server down: replies still running `grace_s` seconds later are ended."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the port is ours from here on: no race with other processes
    port = sock.getsockname()[1]
    server = make_server(app, grace_s=grace_s, log_config=None, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=grace_s + 10)
        sock.close()


@pytest.fixture(scope="session")
def serve_app():
    """`with serve_app(app) as url:` serves one more app for the length of the block."""
    return live_server


@pytest.fixture(scope="session")
def server(engine) -> Iterator[str]:
    """Base URL of a server with the default settings: no API key, 1 MB body limit."""
    with live_server(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="session")
def api_key() -> str:
    return "sk-test-key"


@pytest.fixture(scope="session")
def keyed_server(engine, api_key) -> Iterator[str]:
    """Base URL of a server on the same engine that wants `Authorization: Bearer <api_key>`."""
    with live_server(create_app(engine, api_key=api_key)) as url:
        yield url
