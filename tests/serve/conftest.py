"""Engines and live servers for the serving tests: `make_engine` builds an engine on random weights of
a preset; the fixtures serve one (uvicorn in a background thread on 127.0.0.1, a free port) on the tiny
random `test` preset, compiled once per test process."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Iterator

import jax
import pytest

from meshlm import mesh as meshlib
from meshlm.data.tokenizer import train_tokenizer
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.serve.api.routes import create_app
from meshlm.serve.api.server import make_server
from meshlm.serve.engine.batching import Engine
from meshlm.serve.loading import random_model

F32 = RunPolicy(dtype="float32", param_dtype="float32")

MAX_SEQ_LEN = 256
MAX_BATCH = 8


def make_engine(
    preset: str = "test",
    mesh_dim: str = "1,1,1,1",
    max_batch: int = 8,
    max_seq_len: int = 256,
    seed: int = 0,
    start: bool = True,
    **kw,
) -> Engine:
    """An engine on random float32 weights of a preset with a small byte-level tokenizer, on the first
    devices of the mesh `mesh_dim`; started (compiled) unless `start=False`."""
    cfg = resolve_model(preset)
    n = math.prod(int(x) for x in mesh_dim.split(","))
    mesh = meshlib.build_mesh(meshlib.parse_mesh_dim(mesh_dim, n), jax.devices()[:n])
    tokenizer = train_tokenizer("stdlib", cfg.vocab_size, train_chars=400_000)
    engine = Engine(
        random_model(cfg, mesh, tokenizer, seed=seed, name=preset, policy=F32),
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        **kw,
    )
    return engine.start() if start else engine


@pytest.fixture(scope="session")
def engine():
    engine = make_engine(preset="test", mesh_dim="1,1,1,1", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
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
