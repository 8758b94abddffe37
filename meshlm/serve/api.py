"""An OpenAI-compatible HTTP API over a generation `Engine`, and the chat page.

    serve(engine, host="127.0.0.1", port=8000, api_key=None)   # blocks until Ctrl-C
    app = create_app(engine)                                    # or any ASGI server

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (`"stream": true` answers with
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health`, and the chat page at `/`.

Every request is checked in full before it reaches the engine: its JSON, types and ranges, the model
name, and that prompt + max_tokens fit in the context. A bad one is answered with a 4xx and an
OpenAI-style body, `{"error": {"message", "type", "param", "code"}}`, whose message names the field
and what is wrong with it. With an `api_key`, `/v1/*` wants `Authorization: Bearer <api_key>` (401
otherwise); request bodies above `max_body_bytes` get 413. A client that hangs up mid-request has its
request cancelled in the engine, which frees its batch slot at once. At shutdown, replies still
running after a grace period end with 503 "shutting down" (a stream: an error event) rather than a
cut connection.

Extensions to the OpenAI parameters: `top_k` (0 = off). Parameters this server does not implement
(penalties, logprobs, ...) are ignored, except `n`, which must be 1.
"""

from __future__ import annotations

import hmac
import json
import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator)
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.errors import UsageError
from meshlm.serve.chat import ChatTemplate, ChatTemplateError
from meshlm.serve.engine import Engine, GenerationRequest, RequestHandle
from meshlm.serve.sampling import SamplingParams

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 4


# --------------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """A request the server refuses, as the status and OpenAI-style error body to answer it with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _engine_failure(finish_reason: str | None) -> APIError | None:
    """The error for a request the engine ended without finishing it ("stop" and "length" are fine)."""
    if finish_reason == "error":
        return APIError(500, "generation failed; the server's log says why", type="server_error",
                        code="generation_failed")
    if finish_reason == "cancelled":
        return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    return None


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as `param: what is wrong`."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        detail, position = error.get("ctx", {}).get("error", "a syntax error"), error["loc"][-1]
        return APIError(400, f"the request body is not valid JSON: {detail} at character {position}",
                        code="invalid_json")
    param = ".".join(str(part) for part in error["loc"][1:]) or None  # loc[0] is "body"
    if param is None and error["type"] == "missing":
        return APIError(400, "the request body is empty; send a JSON object", code="invalid_value")
    if param is None and isinstance(error.get("input"), bytes):  # a body FastAPI did not parse as JSON
        return APIError(400, "the request body must be a JSON object sent with the header "
                             "`Content-Type: application/json`", code="invalid_value")
    message = error["msg"] if error["type"] != "missing" else "this field is required"
    return APIError(400, f"{param or 'request body'}: {message}", param=param, code="invalid_value")


# --------------------------------------------------------------------------------------------------
# Request bodies. Strict types: "5" is not a number and true is not 1.


def _unicode(text: str) -> str:
    """JSON may spell a lone surrogate (\\ud800); it is no character, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("text", f"holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at "
                                          f"character {e.start}, which is not text") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]


def _text_content(value: Any) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts, joined."""
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in value
    ):
        return _unicode("".join(part["text"] for part in value))
    raise PydanticCustomError("content", 'must be a string or a list of {"type": "text", "text": ...} parts')


def _stop_strings(value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value if value is not None else ()
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) and s for s in strings):
        raise PydanticCustomError("stop", "must be a non-empty string or a list of them")
    if len(strings) > MAX_STOP_STRINGS:
        raise PydanticCustomError("stop", f"at most {MAX_STOP_STRINGS} strings")
    return tuple(_unicode(s) for s in strings)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _GenerationBody(BaseModel):
    """What completions and chat completions share. Unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0, lt=2**31)] = 0  # the engine holds it as int32
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop_strings)] = ()
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise PydanticCustomError("n", "only n=1 is supported")
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_GenerationBody):
    prompt: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_text_content)]


class ChatCompletionBody(_GenerationBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = None  # the newer name of max_tokens


# --------------------------------------------------------------------------------------------------
# Middleware. Plain ASGI, so that both act before a body is read or parsed.


class _RequireApiKey:
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


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class _LimitBody:
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
            response = APIError(413, _BodyTooLarge(self.limit).detail, code="request_too_large").response()
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
                    raise _BodyTooLarge(self.limit)  # an HTTPException, so the app answers it
            return message

        await self.app(scope, receive_within_limit, send)

    async def _drain(self, receive: Receive) -> None:
        drained = 0
        while drained < self._DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return
            drained += len(message.get("body", b""))


# --------------------------------------------------------------------------------------------------
# From a validated body to an engine request


def _check_model(engine: Engine, body: _GenerationBody) -> None:
    if body.model is not None and body.model != engine.model_name:
        raise APIError(400, f"model: this server serves {engine.model_name!r}, not {body.model!r}",
                       param="model", code="model_not_found")


def _submit(engine: Engine, prompt_ids: list[int], body: _GenerationBody, *, max_tokens: int | None,
            default_max_tokens: int | None, extra_stop: tuple[str, ...] = ()) -> RequestHandle:
    """Hands the request to the engine once prompt + max_tokens are known to fit in the context.

    `max_tokens` None asks for `default_max_tokens`, or for the rest of the context when that is None too.
    """
    context, prompt_len = engine.max_seq_len, len(prompt_ids)
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    room = context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens, and the context is {context} tokens: "
                            f"shorten it to at most {context - 1} tokens, leaving room for the reply",
                       param="messages" if isinstance(body, ChatCompletionBody) else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"max_tokens: {max_tokens} new tokens after the prompt's {prompt_len} exceed the "
                            f"context of {context} tokens; ask for at most {room}",
                       param="max_tokens", code="context_length_exceeded")
    try:
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)
        request = GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling,
                                    stop=body.stop + extra_stop)
        return engine.submit(request)  # checks the request once more before it queues it
    except ValueError as e:  # what the checks above could not know, as the engine words it
        raise APIError(400, str(e), code="invalid_value") from e


# --------------------------------------------------------------------------------------------------
# Responses


def _usage(handle) -> dict[str, int]:
    prompt, completion = handle.prompt_tokens, handle.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chat_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def _chat_delta(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish_reason}


async def _reply_or_hang_up(request: Request, handle) -> tuple[str, str] | None:
    """The whole reply and its finish reason; None if the client hung up first (the engine is told)."""
    parts: list[str] = []
    finish_reason = None

    async def cancel_on_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(cancel_on_disconnect, tasks.cancel_scope)
        try:
            async for event in handle:
                parts.append(event.text)
                finish_reason = event.finish_reason or finish_reason
        finally:
            if finish_reason is None:
                handle.cancel()
        tasks.cancel_scope.cancel()
    return None if finish_reason is None else ("".join(parts), finish_reason)


def _sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _event_stream(handle, chunk: Callable[[list[dict], dict | None], dict],
                        choice: Callable[[str, str | None], dict], *, first_choice: dict | None = None,
                        include_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events: one chunk per engine event, an optional usage chunk, then `[DONE]`.

    `chunk(choices, usage)` makes an event's body; `choice(text, finish_reason)` one choice in it.

    Starlette stops iterating when the client disconnects; the `finally` then cancels the request.
    """
    finished = False
    try:
        if first_choice is not None:
            yield _sse(chunk([first_choice], None))
        async for event in handle:
            finished = event.finish_reason is not None
            if failure := _engine_failure(event.finish_reason):
                yield _sse(failure.body())
                return
            if event.text or finished:
                yield _sse(chunk([choice(event.text, event.finish_reason)], None))
        if include_usage:
            yield _sse(chunk([], _usage(handle)))
        yield _sse("[DONE]")
    except Exception:
        log.exception("streaming a reply failed")
        yield _sse(_engine_failure("error").body())
    finally:
        if not finished:
            handle.cancel()


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# --------------------------------------------------------------------------------------------------
# The app


def create_app(engine: Engine, *, api_key: str | None = None, max_body_bytes: int = 1_000_000) -> FastAPI:
    """The ASGI app serving `engine` (already started; the caller stops it)."""
    template = ChatTemplate.from_source(
        engine.chat_template,
        bos_token=getattr(engine.tokenizer, "bos_token", "") or "",
        eos_token=getattr(engine.tokenizer, "eos_token", "") or "",
    )
    started = int(time.time())
    app = FastAPI(title="meshlm", summary="OpenAI-compatible API for a meshlm model")
    open_requests: weakref.WeakSet[RequestHandle] = weakref.WeakSet()  # replies still being sent

    def end_open_requests() -> None:
        """Ends every reply still running: a whole one answers 503, a stream ends with an error event."""
        for handle in list(open_requests):
            if not handle.done:
                handle.cancel()

    app.state.end_open_requests = end_open_requests  # for the server, at shutdown

    app.add_middleware(_LimitBody, limit=max_body_bytes)
    if api_key:
        app.add_middleware(_RequireApiKey, api_key=api_key)  # outermost: no body is read for a caller without the key

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response(exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, "internal server error", type="server_error").response()

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": started, "owned_by": "meshlm",
                "max_model_len": engine.max_seq_len}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": engine.model_name}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        if model != engine.model_name:
            raise APIError(404, f"no model {model!r}; this server serves {engine.model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        _check_model(engine, body)
        prompt_ids = await run_in_threadpool(engine.tokenizer.encode, body.prompt)
        handle = _submit(engine, prompt_ids, body, max_tokens=body.max_tokens,
                         default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS)
        open_requests.add(handle)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": engine.model_name}

        if body.stream:
            def chunk(choices: list[dict], usage: dict | None) -> dict:
                return {**meta, "choices": choices, "usage": usage}

            events = _event_stream(handle, chunk, _completion_choice, include_usage=body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)

        reply = await _reply_or_hang_up(request, handle)
        if reply is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        if failure := _engine_failure(reply[1]):
            raise failure
        return JSONResponse({**meta, "choices": [_completion_choice(*reply)], "usage": _usage(handle)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        _check_model(engine, body)
        try:
            prompt = template.render([message.model_dump() for message in body.messages])
        except ChatTemplateError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
        prompt_ids = await run_in_threadpool(engine.tokenizer.encode, prompt)
        handle = _submit(engine, prompt_ids, body, max_tokens=body.max_completion_tokens or body.max_tokens,
                         default_max_tokens=None, extra_stop=template.stop)
        open_requests.add(handle)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}

        if body.stream:
            def chunk(choices: list[dict], usage: dict | None) -> dict:
                return {**meta, "object": "chat.completion.chunk", "choices": choices, "usage": usage}

            opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}
            events = _event_stream(handle, chunk, _chat_delta, first_choice=opening,
                                   include_usage=body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)

        reply = await _reply_or_hang_up(request, handle)
        if reply is None:
            return Response(status_code=499)
        if failure := _engine_failure(reply[1]):
            raise failure
        return JSONResponse({**meta, "object": "chat.completion", "choices": [_chat_choice(*reply)],
                             "usage": _usage(handle)})

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html",
                            headers={"Content-Security-Policy": "default-src 'self'", "Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening. Taken before the model loads and compiles, so
    that a busy port or an unknown host fails at once (UsageError) rather than after minutes of work."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host={host}: not an address this machine can bind ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"--host={host} --port={port}: cannot listen there ({e.strerror}); "
                         "choose another --port or stop what holds it") from None
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


def make_server(app: FastAPI, *, grace_s: float = 5.0, **config: Any) -> uvicorn.Server:
    """A uvicorn server for an app from `create_app`; `config` goes to `uvicorn.Config`.

    Run it with `server.run(sockets=[bind(host, port)])`. At SIGINT/SIGTERM it stops accepting
    connections, lets open replies run for `grace_s` seconds, then ends them with 503 "shutting down".
    """
    # uvicorn's own cut-off is only a backstop: ended replies close within a decode step.
    config = uvicorn.Config(app, timeout_graceful_shutdown=grace_s + 5, **config)
    return _Server(config, app.state.end_open_requests, grace_s)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve `engine` over HTTP until SIGINT or SIGTERM. The engine is the caller's to start and stop.

    `sock`, from `bind(host, port)`, is used instead of binding here."""
    sock = sock or bind(host, port)
    server = make_server(create_app(engine, api_key=api_key), host=host, port=port, log_level=log_level)
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
