"""The HTTP API from the outside: the official `openai` client, raw HTTP for bad input, a load of
concurrent streams, API keys, body limits and clients that hang up."""

from __future__ import annotations

import asyncio
import importlib
import json
import socket
import threading
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from meshlm.data.chat_template import ChatTemplate, ChatTemplateError
from meshlm.errors import UsageError
from meshlm.serve.api.routes import create_app
from meshlm.serve.api.server import bind


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        yield http


def assert_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Still there?", "max_tokens": 2, "temperature": 0.0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1, response.json()


class _RecordingHandle:
    """Passes everything through to the engine's handle, and keeps its request and whether it was cancelled."""

    def __init__(self, handle, request):
        self._handle, self.request = handle, request
        self.cancelled = threading.Event()

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __aiter__(self):
        return self._handle.__aiter__()

    def cancel(self):
        self.cancelled.set()
        self._handle.cancel()


@pytest.fixture
def handles(engine, monkeypatch) -> list[_RecordingHandle]:
    recorded = []
    submit_batch = engine.submit_batch  # which `submit` calls too

    def recording_submit_batch(requests):
        recorded.extend(_RecordingHandle(h, r) for h, r in zip(submit_batch(requests), requests))
        return recorded[-len(requests) :]

    monkeypatch.setattr(engine, "submit_batch", recording_submit_batch)
    return recorded


# --------------------------------------------------------------------------------------------------
# The openai client


def test_completion(client, engine):
    completion = client.completions.create(
        model=engine.model_name, prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert completion.object == "text_completion"
    assert completion.model == engine.model_name
    [choice] = completion.choices
    assert isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens == len(engine.tokenizer.encode("Once upon a time"))
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_completion_matches_the_whole_one(client, engine):
    request = dict(model=engine.model_name, prompt="The quick brown fox", max_tokens=12, temperature=0)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_streamed_echo_of_max_tokens_0_is_an_event_stream(client, engine):
    """`echo` with `max_tokens: 0` scores the prompt only; streamed, it is one chunk with the prompt."""
    chunks = list(
        client.completions.create(
            model=engine.model_name,
            prompt="The cat",
            max_tokens=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.choices[0].text for c in chunks[:-1]] == ["The cat"], chunks
    assert chunks[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 0


def test_chat_completion(client, engine):
    chat = client.chat.completions.create(
        model=engine.model_name,
        max_tokens=8,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
    )
    assert chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 8


def test_streamed_chat_completion_matches_the_whole_one(client, engine):
    request = dict(
        model=engine.model_name,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
    )
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seeded_sampling_repeats(client, engine):
    request = dict(
        model=engine.model_name,
        prompt="Roll the dice:",
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50},
    )
    first, second = (client.completions.create(**request).choices[0].text for _ in range(2))
    assert first == second


def test_models_and_health(client, http, engine):
    assert [m.id for m in client.models.list().data] == [engine.model_name]
    assert client.models.retrieve(engine.model_name).id == engine.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["shapes_compiled"] == health["shapes"] == engine.warmed()[1]


def test_sse_wire_format(http):
    """What a client without the openai library sees: `data: {json}` events, then `data: [DONE]`."""
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"] in ("stop", "length")


# --------------------------------------------------------------------------------------------------
# Bad input: a 4xx naming the problem, and the server goes on serving

LONG_PROMPT = "word " * 5000  # longer than any test engine's context
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}

BAD_REQUESTS = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ', "json"),
    "empty body": ("/v1/completions", b"", "empty"),
    "not an object": ("/v1/completions", ["Hi"], "not a json object"),
    "missing prompt": ("/v1/completions", {"max_tokens": 4}, "prompt"),
    "unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, "model"),
    "unknown chat model": ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, "model"),
    "prompt longer than the context": ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt"),
    "chat longer than the context": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        "messages",
    ),
    "max_tokens 0": ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, "max_tokens"),
    "max_tokens beyond the context": ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "max_tokens"),
    "temperature < 0": ("/v1/completions", {"prompt": "Hi", "temperature": -0.1}, "temperature"),
    "top_p 0": ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
    "top_p > 1": ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    "top_k < 0": ("/v1/completions", {"prompt": "Hi", "top_k": -1}, "top_k"),
    "top_k beyond int32": ("/v1/completions", {"prompt": "Hi", "temperature": 1.0, "top_k": 2**31}, "top_k"),
    "lone surrogate in the prompt": ("/v1/completions", b'{"prompt": "Hi \\ud800"}', "prompt"),
    "lone surrogate in a message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        "messages.0.content",
    ),
    "lone surrogate in stop": ("/v1/completions", b'{"prompt": "Hi", "stop": ["\\ud800"]}', "stop"),
    "max_tokens as a string": ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    "max_tokens as a float": ("/v1/completions", {"prompt": "Hi", "max_tokens": 5.5}, "max_tokens"),
    "temperature as a string": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    "stream as a string": ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream"),
    "prompt as a number": ("/v1/completions", {"prompt": 42}, "prompt"),
    "seed as a bool": ("/v1/completions", {"prompt": "Hi", "seed": True}, "seed"),
    "stop as a number": ("/v1/completions", {"prompt": "Hi", "stop": 7}, "stop"),
    "messages as a string": ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
    "no messages": ("/v1/chat/completions", {"messages": []}, "messages"),
    "message without content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
    "image content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages.0.content",
    ),
    "n = 2": ("/v1/completions", {"prompt": "Hi", "n": 2}, "n"),
    "n = 2 in chat": ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=str)
def test_bad_input_is_a_4xx_and_the_server_goes_on(http, handles, case):
    path, body, named = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"], error
    assert named in (error["param"] or "") or named in error["message"].lower(), error
    assert handles == [], "a bad request reached the engine"
    assert_serving(http)


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_not_sent_as_json_names_the_header(http, handles, content_type):
    """`curl -d` without `-H "Content-Type: application/json"` is told what to add."""
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post("/v1/completions", content=b'{"prompt": "Hi"}', headers=headers)
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    assert handles == []


def test_unknown_route_and_method(http):
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/completions").status_code == 405
    assert "error" in http.get("/v1/nothing").json()


def test_a_busy_port_is_a_usage_error():
    """`meshlm serve` takes its port before loading the model: a busy one fails at once, with the fix."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UsageError, match=f"--port={port}: cannot listen there.*another --port"):
            bind("127.0.0.1", port)
    with pytest.raises(
        UsageError,
        match=r"--host=192.0.2.1 is not an address of this machine; use 127.0.0.1 "
        r"\(this machine only\) or 0.0.0.0 \(every interface\)",
    ):
        bind("192.0.2.1", 8000)  # a documentation address, on no interface here: refused without any traffic


# --------------------------------------------------------------------------------------------------
# API key and body size


def test_max_tokens_up_to_the_context(http, engine, handles):
    """Prompt + max_tokens may fill the context exactly, and not one token more."""
    room = engine.max_seq_len - len(engine.tokenizer.encode("Hi"))
    too_many = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": room + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert str(room) in too_many.json()["error"]["message"]  # says how many would fit
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": room, "stream": True}) as r:
        assert r.status_code == 200
    assert [h.request.max_tokens for h in handles] == [room]


def test_api_key(keyed_server, engine, api_key):
    wrong = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2)
    response = httpx.post(f"{keyed_server}/v1/chat/completions", json=CHAT)  # no Authorization at all
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{keyed_server}/v1/models").status_code == 401

    good = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key=api_key, max_retries=0)
    assert good.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(f"{keyed_server}/health").status_code == 200  # the page and health checks stay open
    assert httpx.get(f"{keyed_server}/").status_code == 200


def test_the_chat_page_files_are_served_and_packaged(http):
    for path in ("/", "/static/chat.js", "/static/chat.css"):
        assert http.get(path).status_code == 200, path
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    for package, patterns in pyproject["tool"]["setuptools"]["package-data"].items():
        folder = Path(importlib.import_module(package).__file__).parent
        assert all(list(folder.glob(p)) for p in patterns), f"package-data of {package}: nothing matches {patterns}"


def test_huge_body_is_413(http):
    huge = json.dumps({"prompt": "x" * 2_000_000, "max_tokens": 1}).encode()
    response = http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]
    assert_serving(http)


def test_huge_chunked_body_is_413(http):
    """No Content-Length: the limit is found while reading."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 50_000
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert_serving(http)


# --------------------------------------------------------------------------------------------------
# Clients that hang up


def test_ignore_eos_runs_past_the_end_of_text_token(http, engine, handles, monkeypatch):
    """The `ignore_eos` extension: with the greedy first token made the end-of-text token, a request stops
    at once without it and runs to max_tokens with it."""
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.0}
    first = http.post("/v1/completions", json={**body, "max_tokens": 1, "ignore_eos": True})
    assert first.status_code == 200, first.text
    monkeypatch.setattr(engine, "eos_id", handles[-1]._ids[0])  # the greedy first token
    stopped = http.post("/v1/completions", json=body).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 0, stopped
    kept = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert kept["choices"][0]["finish_reason"] == "length" and kept["usage"]["completion_tokens"] == 6, kept
    assert [h.request.ignore_eos for h in handles] == [True, False, True]
    bad = http.post("/v1/completions", json={**body, "ignore_eos": "yes"})
    assert bad.status_code == 400 and "ignore_eos" in bad.text, bad.text


def _long_request(engine) -> dict:
    return {"prompt": "Go on and on", "max_tokens": engine.max_seq_len - 16, "temperature": 0.0}


@pytest.fixture
def slow_tokens(engine, monkeypatch):
    """The test model makes a token in well under a millisecond: slow each one down (5 ms) so that a
    long request is still running when its client hangs up."""
    decode = engine.tokenizer.decode

    def slow_decode(ids):
        time.sleep(0.005)
        return decode(ids)

    monkeypatch.setattr(engine.tokenizer, "decode", slow_decode)


@pytest.mark.usefixtures("slow_tokens")
def test_hanging_up_a_stream_cancels_the_request(server, http, engine, handles):
    request = _long_request(engine)
    with httpx.Client(base_url=server, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
            next(response.iter_lines())
    [handle] = handles
    assert handle.cancelled.wait(10), "the engine was not told"
    assert handle.completion_tokens < request["max_tokens"]
    assert_serving(http)


@pytest.mark.usefixtures("slow_tokens")
def test_hanging_up_a_whole_request_cancels_it(server, http, engine, handles):
    request = _long_request(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=request, timeout=httpx.Timeout(60, read=0.2))
    [handle] = handles
    assert handle.cancelled.wait(10), "the engine was not told"
    assert handle.completion_tokens < request["max_tokens"]
    assert_serving(http)


@pytest.mark.usefixtures("slow_tokens")
def test_shutdown_ends_open_replies_with_503(engine, handles, serve_app):
    """A server shutting down lets replies run for its grace period, then ends them properly: a whole
    reply answers 503 and a stream closes with an error event; neither connection is just cut."""
    request, grace_s = _long_request(engine), 0.5
    streamed_events, whole = [], []
    first_event = threading.Event()

    def stream(url):
        with httpx.stream("POST", f"{url}/v1/completions", json={**request, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    streamed_events.append(line.removeprefix("data: "))
                    first_event.set()

    def post(url):
        whole.append(
            httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 200, "ignore_eos": True}, timeout=60)
        )

    with serve_app(create_app(engine), grace_s=grace_s) as url:
        clients = [threading.Thread(target=client, args=(url,)) for client in (stream, post)]
        for client in clients:
            client.start()
        assert first_event.wait(30)
        while len(handles) < 2:
            time.sleep(0.01)
        shutdown = time.perf_counter()
    took = time.perf_counter() - shutdown
    for client in clients:
        client.join(10)
    [response] = whole
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down", response.text
    assert json.loads(streamed_events[-1])["error"]["code"] == "shutting_down", streamed_events[-3:]
    assert all(h.cancelled.is_set() and h.completion_tokens < h.request.max_tokens for h in handles)
    assert grace_s <= took < grace_s + 3, took


# --------------------------------------------------------------------------------------------------
# Load


def test_32_concurrent_streaming_clients(server, engine):
    """32 clients × 4 streamed requests each, chat and plain in turn: every one completes, none fails."""
    n_clients, n_requests, max_tokens = 32, 4, 12

    async def one_client(i: int) -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
        counts = []
        async with client:
            for j in range(n_requests):
                common = dict(
                    model=engine.model_name,
                    max_tokens=max_tokens,
                    stream=True,
                    seed=i * n_requests + j,
                    stream_options={"include_usage": True},
                )
                if j % 2:
                    stream = await client.chat.completions.create(
                        **common, messages=[{"role": "user", "content": f"Client {i}, request {j}"}]
                    )
                else:
                    stream = await client.completions.create(**common, prompt=f"Client {i}, request {j}:")
                finish, usage = None, None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    usage = chunk.usage or usage
                assert finish in ("stop", "length")
                counts.append(usage.completion_tokens)
        return counts

    async def all_clients():
        return await asyncio.gather(*(one_client(i) for i in range(n_clients)))

    compiled, steps = engine.compiled_shapes(), engine.stats["decode_steps"]
    start = time.perf_counter()
    counts = asyncio.run(all_clients())  # any 4xx/5xx or error event raises in the openai client
    elapsed = time.perf_counter() - start
    steps = engine.stats["decode_steps"] - steps
    assert len(counts) == n_clients and all(len(c) == n_requests for c in counts)
    assert all(1 <= n <= max_tokens for c in counts for n in c)
    tokens = sum(map(sum, counts))
    print(f"{n_clients * n_requests} streamed requests, {tokens} tokens in {steps} decode steps, {elapsed:.1f} s")
    assert engine.compiled_shapes() == compiled, "traffic compiled a new shape"
    assert steps < tokens / 2, "concurrent requests did not share decode steps"


# --------------------------------------------------------------------------------------------------
# Chat templates

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRICT = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}{% endif %}"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_default_template_is_a_plain_transcript():
    template = ChatTemplate()
    assert template.render(CONVERSATION) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert template.stop == ("\nUser:",)


def test_model_template_renders_like_transformers():
    template = ChatTemplate.from_source(CHATML, bos_token="<s>", eos_token="</s>")
    assert template.render(CONVERSATION) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.stop == ("<|im_end|>",)  # the model ends its turn with its own marker
    assert ChatTemplate.from_source(None) == ChatTemplate.from_source("") == ChatTemplate()
    with pytest.raises(ChatTemplateError, match="the first message must be the user"):
        ChatTemplate.from_source(STRICT).render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate.from_source("{% for %}").render(CONVERSATION)


class _WithTemplate:
    """The test engine, with the chat template a model folder would give it."""

    def __init__(self, engine, chat_template: str):
        self._engine, self.chat_template = engine, chat_template

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_the_model_template_renders_chat_prompts(engine, handles, serve_app):
    app = create_app(_WithTemplate(engine, CHATML + STRICT))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        ok = http.post("/v1/chat/completions", json={"messages": CONVERSATION[1:], "max_tokens": 2})
        refused = http.post("/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    [handle] = handles
    rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert handle.request.prompt_ids == engine.tokenizer.encode(rendered)
    assert handle.request.stop == ("<|im_end|>",)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "messages: the first message must be the user"
