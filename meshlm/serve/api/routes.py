"""The HTTP API's app: its routes, how a validated body becomes an engine request, its error handlers.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (their work: meshlm/serve/api/completions.py),
`GET /v1/models`, `GET /v1/models/{id}`, `GET`/`HEAD /health`, and the chat page at `/` (files under
meshlm/serve/api/static). Before a request reaches the engine, the model name is checked and prompt +
max_tokens must fit in the context.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshlm.data.chat_template import ChatTemplate
from meshlm.serve.api import completions as generation
from meshlm.serve.api.docs import add_docs
from meshlm.serve.api.errors import APIError, http_error, server_error, validation_error
from meshlm.serve.api.middleware import LimitBody, RequireApiKey
from meshlm.serve.api.schemas import ChatCompletionBody, CompletionBody
from meshlm.serve.engine.batching import Engine
from meshlm.serve.engine.request import RequestHandle

STATIC_DIR = Path(__file__).parent / "static"


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
        return http_error(exc, request.method, request.url.path).response(exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        return server_error().response()


def create_app(engine: Engine, *, api_key: str | None = None, max_body_bytes: int = 1_000_000) -> FastAPI:
    """The ASGI app serving `engine` (already started; the caller stops it)."""
    template = ChatTemplate.from_source(
        engine.chat_template,
        bos_token=getattr(engine.tokenizer, "bos_token", "") or "",
        eos_token=getattr(engine.tokenizer, "eos_token", "") or "",
    )
    started = int(time.time())
    app = FastAPI(title="meshlm", summary="OpenAI-compatible API for a meshlm model", docs_url=None, redoc_url=None)
    add_docs(app)  # /docs without the internet's scripts; behind the API key like /openapi.json
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
        return {
            "id": engine.model_name,
            "object": "model",
            "created": started,
            "owned_by": "meshlm",
            "max_model_len": engine.max_seq_len,
        }

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        compiled, shapes = engine.warmed()  # while shapes remain the server answers, some requests slower
        return {
            "status": "ok" if compiled >= shapes else "warming_up",
            "model": engine.model_name,
            "shapes_compiled": compiled,
            "shapes": shapes,
        }

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        if model != engine.model_name:
            raise APIError(
                404,
                f"no model {model!r}; this server serves {engine.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await generation.completions(engine, body, request, open_requests)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        return await generation.chat_completions(engine, template, body, request, open_requests)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(
            STATIC_DIR / "index.html",
            headers={"Content-Security-Policy": "default-src 'self'", "Cache-Control": "no-cache"},
        )

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


__all__ = ["create_app", "add_error_handlers", "STATIC_DIR"]
