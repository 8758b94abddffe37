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

Completions take a prompt as a string, a list of strings, a list of token ids or a list of such lists
(run together in the engine's batch, choices in prompt order), `echo`, and `logprobs` (the k likeliest
alternatives per token, OpenAI's `tokens`/`token_logprobs`/`top_logprobs`/`text_offset`);
`max_tokens: 0` with `echo` scores the prompt only. Chat takes `logprobs: true` and `top_logprobs`.
Log-probabilities come from `meshlm.serve.scoring.Scorer`, run by the engine a chunk at a time between
its decode steps, so other streams go on; a reply is built off the event loop. The engine shares its
slots fairly between requests; limits on one request (new tokens of a batch, log-probabilities
returned) are 400s, and a full queue is 429 (meshlm/serve/limits.py). `null` means the default wherever OpenAI
accepts it. Extensions to the OpenAI parameters: `top_k` (0 = off). Parameters this server does not
implement (penalties, ...) are ignored, except `n`, which must be 1.

Connections must send a request's head within 10 s and its body within 30 s (api_timeouts); a body
announced over the limit is refused before it is read, and a prompt far over the context before it
is tokenized.

This module is the API's entry point; its parts, each in its own module:

    api_schemas      the request bodies (types, ranges, text, nulls)
    api_errors       refusals as OpenAI-style error bodies
    api_middleware   the API key and the body size limit (plain ASGI)
    api_prompts      prompts to engine requests: tokenizing, fitting in the context
    api_completions  the two generation endpoints: batches of prompts, echo, log-probabilities, limits
    api_logprobs     log-probabilities in OpenAI's shapes
    api_replies      whole and streamed (server-sent events) replies, cancelling on hang-up
    api_routes       the app: routes, error handlers, `create_app`
    api_timeouts     deadlines for a request's head and body (uvicorn's h11 protocol)
    api_server       the socket, the uvicorn server, shutdown and signals: `bind`, `make_server`, `serve`
"""

from __future__ import annotations

from meshlm.serve.api_errors import APIError
from meshlm.serve.api_routes import create_app
from meshlm.serve.api_server import bind, make_server, serve

__all__ = ["create_app", "bind", "make_server", "serve", "APIError"]
