"""The HTTP API's app: its routes, how a validated body becomes an engine request, its error handlers.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/models/{id}`,
`GET /health`, and the chat page at `/` (files under meshlm/serve/static). Before a request reaches
the engine, the model name is checked and prompt + max_tokens must fit in the context.
"""

from __future__ import annotations

import time
import uuid
import weakref
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshlm.serve import api_replies as replies
from meshlm.serve.api_errors import APIError, engine_failure, validation_error
from meshlm.serve.api_middleware import LimitBody, RequireApiKey
from meshlm.serve.api_schemas import ChatCompletionBody, CompletionBody, GenerationBody
from meshlm.serve.chat import ChatTemplate, ChatTemplateError
from meshlm.serve.engine import Engine
from meshlm.serve.request import GenerationRequest, RequestHandle
from meshlm.serve.sampling import SamplingParams

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def check_model(engine: Engine, body: GenerationBody) -> None:
    if body.model is not None and body.model != engine.model_name:
        raise APIError(400, f"model: this server serves {engine.model_name!r}, not {body.model!r}",
                       param="model", code="model_not_found")


def submit(engine: Engine, prompt_ids: list[int], body: GenerationBody, *, max_tokens: int | None,
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


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered with an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response(exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, "internal server error", type="server_error").response()


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

    app.add_middleware(LimitBody, limit=max_body_bytes)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)  # outermost: no body is read for a caller without the key
    add_error_handlers(app)

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
        check_model(engine, body)
        prompt_ids = await run_in_threadpool(engine.tokenizer.encode, body.prompt)
        handle = submit(engine, prompt_ids, body, max_tokens=body.max_tokens,
                        default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS)
        open_requests.add(handle)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": engine.model_name}

        if body.stream:
            def chunk(choices: list[dict], usage: dict | None) -> dict:
                return {**meta, "choices": choices, "usage": usage}

            events = replies.event_stream(handle, chunk, replies.completion_choice, include_usage=body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=replies.SSE_HEADERS)

        reply = await replies.reply_or_hang_up(request, handle)
        if reply is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        if failure := engine_failure(reply[1]):
            raise failure
        return JSONResponse({**meta, "choices": [replies.completion_choice(*reply)], "usage": replies.usage(handle)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        check_model(engine, body)
        try:
            prompt = template.render([message.model_dump() for message in body.messages])
        except ChatTemplateError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
        prompt_ids = await run_in_threadpool(engine.tokenizer.encode, prompt)
        handle = submit(engine, prompt_ids, body, max_tokens=body.max_completion_tokens or body.max_tokens,
                        default_max_tokens=None, extra_stop=template.stop)
        open_requests.add(handle)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}

        if body.stream:
            def chunk(choices: list[dict], usage: dict | None) -> dict:
                return {**meta, "object": "chat.completion.chunk", "choices": choices, "usage": usage}

            events = replies.event_stream(handle, chunk, replies.chat_delta, first_choice=replies.chat_opening(),
                                          include_usage=body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=replies.SSE_HEADERS)

        reply = await replies.reply_or_hang_up(request, handle)
        if reply is None:
            return Response(status_code=499)
        if failure := engine_failure(reply[1]):
            raise failure
        return JSONResponse({**meta, "object": "chat.completion", "choices": [replies.chat_choice(*reply)],
                             "usage": replies.usage(handle)})

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html",
                            headers={"Content-Security-Policy": "default-src 'self'", "Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


__all__ = ["create_app", "check_model", "submit", "add_error_handlers", "STATIC_DIR", "DEFAULT_COMPLETION_MAX_TOKENS"]
