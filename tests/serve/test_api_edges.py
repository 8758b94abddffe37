"""The HTTP API's edges: every refusal a JSON error with a code and the fix, seeds over the whole signed
64-bit range, /docs and /openapi.json behind the key and loading nothing, and a fuzz of bad requests
that must never get a 5xx."""

from __future__ import annotations

import json
import random
import re
import socket

import httpx
import jax
import numpy as np
import pytest

from meshlm.serve.engine.sampling import seed_key


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        yield http


def assert_error(response: httpx.Response, status: int, code: str, *says: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    for text in says:
        assert text in error["message"], error


JSON = {"Content-Type": "application/json"}


def test_each_refusal_has_a_code_and_names_the_fix(http):
    post = lambda body, headers=JSON: http.post("/v1/completions", content=body, headers=headers)  # noqa: E731
    assert_error(
        post(b'{"prompt": "Hi" "max_tokens": 3}'),
        400,
        "invalid_json",
        "not valid JSON: Expecting ',' delimiter at line 1 column 17",
        "send one JSON object",
    )
    assert_error(post(b'{"prompt":\n "Hi",\n}'), 400, "invalid_json", "at line 3 column 1")
    assert_error(post(b'{"prompt": "\xff"}'), 400, "invalid_json", "cannot be decoded as utf-8: byte 0xff at offset 12")
    assert_error(post(b"[" * 100_000), 400, "invalid_json", "nests", "too deeply")
    assert_error(post(b'{"prompt": "Hi", "seed": 1' + b"0" * 5000 + b"}"), 400, "invalid_json", "4300 digits")
    assert_error(
        post(b'{"prompt": "Hi"}', {"Content-Type": "text/plain"}),
        400,
        "invalid_value",
        "`Content-Type: application/json`",
    )
    assert_error(
        post(b'{"prompt": "Hi", "max_tokens": "5"}'),
        400,
        "invalid_value",
        'max_tokens: Input should be a valid integer; got a string ("5")',
    )
    assert_error(post(b"7"), 400, "invalid_value", "the request body is an integer (7), not a JSON object")
    assert_error(http.get("/v1/nothing"), 404, "not_found", "no route GET /v1/nothing", "POST /v1/completions")
    assert_error(http.get("/v1/completions"), 405, "method_not_allowed", "GET is not allowed", "use POST")
    assert_error(http.delete("/health"), 405, "method_not_allowed", "DELETE is not allowed on /health; use ", "GET")


# --------------------------------------------------------------------------------------------------
# Seeds


def test_seed_keys_are_64_bits_and_keep_the_32_bit_ones():
    for seed in (0, 5, 2**31, 2**32 - 1):  # what jax.random.key made for these before, so their text stays
        np.testing.assert_array_equal(seed_key(seed), jax.random.key_data(jax.random.key(seed)))
    seeds = [5, 5 + 2**32, -5, 2**32 - 5, -1, 2**63 - 1, -(2**63), 0]
    assert len({tuple(seed_key(s)) for s in seeds}) == len(seeds)


def test_seeds_beyond_32_bits_give_their_own_samples(http, engine):
    def sample(seed: int) -> list[int]:
        body = {
            "prompt": "Roll the dice:",
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": seed,
            "ignore_eos": True,
            "logprobs": 0,
        }
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["tokens"]

    assert sample(5) == sample(5)
    assert sample(5) != sample(5 + 2**32)  # one key before: the seed was taken mod 2^32
    assert sample(-5) == sample(-5) != sample(2**32 - 5)  # negative seeds are their own too
    assert_error(http.post("/v1/completions", json={"prompt": "Hi", "seed": 2**63}), 400, "invalid_value", "seed")


# --------------------------------------------------------------------------------------------------
# /docs and /openapi.json


def test_docs_want_the_key_and_load_nothing_from_outside(keyed_server, api_key):
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert_error(httpx.get(f"{keyed_server}{path}"), 401, "invalid_api_key")
    key = {"Authorization": f"Bearer {api_key}"}
    assert "/v1/completions" in httpx.get(f"{keyed_server}/openapi.json", headers=key).json()["paths"]
    page = httpx.get(f"{keyed_server}/docs", headers=key)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text and "max_tokens" in page.text
    assert not re.search(r"https?:|//[a-z]", page.text, re.IGNORECASE), "the docs page names an outside address"
    assert not re.search(r"<(script|link|img|iframe)\b", page.text), "the docs page loads something"
    assert page.headers["content-security-policy"].startswith("default-src 'none'")


# --------------------------------------------------------------------------------------------------
# Fuzz: bad requests of every shape get a 4xx JSON error with a code, never a 5xx

ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    -(2**64),
    1e308,
    -0.0,
    0.5,
    "",
    "x",
    "5",
    "\u00e9\u4e2d",
    "\ud800",
    [],
    [1],
    ["x"],
    [[1, 2]],
    [[]],
    [None],
    {},
    {"a": 1},
    {"type": "text"},
    [{"type": "text"}],
]
BASES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2, "temperature": 0.0},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 2,
        "temperature": 0.0,
    },
}
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "echo",
    "logprobs",
    "top_logprobs",
    "stream_options",
    "ignore_eos",
    "model",
    "unknown_field",
]


def _fuzz_bodies(count: int, rng: random.Random) -> list[tuple[str, bytes]]:
    """Valid bodies with one to three fields set to odd values (those that stay valid generate at most 16
    tokens: chat's max_completion_tokens wins over max_tokens), and broken encodings of them."""
    bodies = []
    for _ in range(count):
        path = rng.choice(list(BASES))
        body = dict(BASES[path])
        for field in rng.sample(FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(ODD_VALUES)
        raw = json.dumps(body).encode()
        cut = rng.random()
        if cut < 0.1:
            raw = raw[: rng.randrange(len(raw))]  # truncated
        elif cut < 0.15:
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))  # noise
        bodies.append((path, raw))
    return bodies


def test_fuzzed_requests_never_get_a_server_error(http):
    for path, raw in _fuzz_bodies(150, random.Random(35)):
        response = http.post(path, content=raw, headers=JSON)
        assert response.status_code < 500, (raw, response.text)
        if response.status_code >= 400:
            assert response.headers["content-type"] == "application/json", (raw, response.text)
            assert response.json()["error"]["code"], (raw, response.text)


def test_a_request_that_is_not_http_gets_a_json_error(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n")
        head, _, body = b"".join(iter(lambda: conn.recv(65536), b"")).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head, head  # was text/plain
    assert json.loads(body)["error"]["code"] == "invalid_http"
