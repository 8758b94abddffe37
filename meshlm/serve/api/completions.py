"""The two generation endpoints' work: `/v1/completions` and `/v1/chat/completions`.

Completions take one prompt or a batch (strings or token ids): every prompt is checked first, then all
are queued at once, so they run together in the engine's batch, and the choices come back in prompt
order (`index`). With `echo` a choice's text starts with its prompt; `max_tokens: 0` with `echo` only
scores the prompt (streamed: one event with the prompt, then `[DONE]`). `logprobs` (and chat's
`logprobs`/`top_logprobs`) are the model's own, computed over each prompt and the tokens generated for
it after generation, by the engine in chunks between its decode steps (Engine.submit_scores), so
other streams go on meanwhile; the reply is built in a worker thread, off the event loop.

Limits, the engine's (`meshlm serve` flags): a batch of several prompts may ask for at most
`max_request_tokens` new tokens in all (prompts × max_tokens); a request may return at most
`max_logprobs` log-probabilities (tokens shown × (alternatives + 1)); a full queue answers 429.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshlm.data.chat_template import ChatTemplate, ChatTemplateError
from meshlm.serve.api import replies
from meshlm.serve.api.errors import APIError, engine_failure
from meshlm.serve.api.logprobs import chat_logprobs, completion_logprobs
from meshlm.serve.api.prompts import check_fits, check_token_ids, prepare, tokenize
from meshlm.serve.api.schemas import ChatCompletionBody, CompletionBody, GenerationBody
from meshlm.serve.engine.limits import QueueFull

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def check_model(engine: Any, body: GenerationBody) -> None:
    if body.model is not None and body.model != engine.model_name:
        raise APIError(
            400,
            f"model: this server serves {engine.model_name!r}, not {body.model!r}",
            param="model",
            code="model_not_found",
        )


def _scorer(engine: Any, param: str):
    try:
        return engine.scorer()
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from e


def check_logprobs_limit(engine: Any, tokens: int, top: int, param: str) -> None:
    """400 if a reply would hold more than the engine's `max_logprobs` log-probabilities."""
    values, limit = tokens * (top + 1), engine.max_logprobs
    if values > limit:
        raise APIError(
            400,
            f"{param}: this request would return log-probabilities for up to {tokens:,} tokens with "
            f"{top} alternatives each, {values:,} values (tokens × (alternatives + 1)), over this "
            f"server's limit of {limit:,} per request (--max_logprobs); ask for fewer alternatives, "
            "or send fewer or shorter prompts or a lower max_tokens",
            param=param,
            code="too_many_logprobs",
        )


def check_request_tokens(engine: Any, requests: list) -> None:
    """400 if a batch of several prompts asks for more than the engine's `max_request_tokens` in all."""
    total, limit = sum(r.max_tokens for r in requests), engine.max_request_tokens
    if len(requests) > 1 and total > limit:
        raise APIError(
            400,
            f"max_tokens: {len(requests)} prompts × up to {max(r.max_tokens for r in requests)} new "
            f"tokens each = {total:,} tokens to generate, over this server's limit of {limit:,} per "
            "request (--max_request_tokens); send fewer prompts per request or a lower max_tokens",
            param="max_tokens",
            code="too_many_tokens",
        )


def _queue_full(e: QueueFull) -> APIError:
    return APIError(429, str(e), type="server_error", code="queue_full")


def submit(engine: Any, requests: list, open_requests) -> list:
    """Queue requests together in the engine (429 when its queue is full); their handles."""
    try:
        handles = engine.submit_batch(requests)
    except QueueFull as e:
        raise _queue_full(e) from None
    open_requests.update(handles)
    return handles


async def _score(
    engine: Any, request: Request, open_requests, sequences: list[list[int]], top: int, *, queue: bool
) -> list | None:
    """The sequences' Scores, scored by the engine between its decode steps; None if the client hung up."""
    try:
        handle = engine.submit_scores(sequences, top, queue=queue)
    except QueueFull as e:
        raise _queue_full(e) from None
    except ValueError as e:
        raise APIError(400, f"logprobs: {e}", param="logprobs", code="invalid_value") from e
    open_requests.add(handle)
    return await replies.scores_or_hang_up(request, handle)


def _prompt_ids(engine: Any, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        return tokenize(engine, prompt, param)
    check_token_ids(engine, prompt, param)
    return prompt


def _check_completion_body(engine: Any, body: CompletionBody) -> None:
    """400 for what /v1/completions refuses before any work: streaming several prompts or logprobs,
    max_tokens 0 without echo, and logprobs where scoring is not available."""
    several = len(body.prompt) > 1
    if body.stream and (several or body.logprobs is not None):
        what = "a list of several prompts" if several else "logprobs"
        raise APIError(
            400,
            f"{'prompt' if several else 'logprobs'}: {what} cannot be streamed; send \"stream\": false",
            param="prompt" if several else "logprobs",
            code="invalid_value",
        )
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400,
            "max_tokens: 0 generates nothing; ask for at least 1, or set \"echo\": true to score the prompt",
            param="max_tokens",
            code="invalid_value",
        )
    if body.logprobs is not None:
        _scorer(engine, "logprobs")  # refused before any work where scoring is not available


def _echo_only_replies(engine: Any, body: CompletionBody, ids: list[list[int]]) -> list:
    """max_tokens 0 with echo: the prompts checked to fit (and their logprobs to be within the limit);
    an empty Reply for each."""
    for p in ids:
        check_fits(engine, p, "prompt", room_needed=0)
    if body.logprobs is not None:
        check_logprobs_limit(engine, sum(map(len, ids)), body.logprobs, "logprobs")
    return [replies.Reply("", [], "length") for _ in ids]


def _echo_only_stream(engine: Any, body: CompletionBody, ids: list[list[int]], texts: list, chunk) -> Response:
    """The stream of an echo-only request: one prompt, no logprobs (refused before), its echo the whole stream."""
    echoed = [chunk([replies.completion_choice(_prompt_text(engine, texts[0], ids[0]), "length")], None)]
    if body.include_usage:
        echoed.append(chunk([], replies.usage_of(len(ids[0]), 0)))
    return StreamingResponse(replies.fixed_stream(echoed), media_type="text/event-stream", headers=replies.SSE_HEADERS)


async def _generated_replies(
    engine: Any, body: CompletionBody, request: Request, open_requests, ids: list[list[int]], texts: list, chunk
) -> list | Response:
    """The prompts' completions, generated together: their Replies, or the Response itself where it
    streams or the client hung up (499)."""
    requests = [
        prepare(engine, p, body, max_tokens=body.max_tokens, default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS)
        for p in ids
    ]
    check_request_tokens(engine, requests)
    if body.logprobs is not None:
        shown = sum(r.max_tokens + (len(p) if body.echo else 0) for p, r in zip(ids, requests))
        check_logprobs_limit(engine, shown, body.logprobs, "logprobs")
    handles = submit(engine, requests, open_requests)  # all queued together, sharing slots fairly
    if body.stream:
        echo = replies.completion_choice(_prompt_text(engine, texts[0], ids[0]), None) if body.echo else None
        events = replies.event_stream(
            handles[0], chunk, replies.completion_choice, first_choice=echo, include_usage=body.include_usage
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=replies.SSE_HEADERS)
    outs = await replies.replies_or_hang_up(request, handles)
    if outs is None:
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    for out in outs:
        if failure := engine_failure(out.finish_reason):
            raise failure
    return outs


async def completions(engine: Any, body: CompletionBody, request: Request, open_requests) -> Response:
    check_model(engine, body)
    _check_completion_body(engine, body)
    prompts = body.prompt

    def all_ids() -> list[list[int]]:
        return [_prompt_ids(engine, p, "prompt") for p in prompts]

    ids = await run_in_threadpool(all_ids) if any(isinstance(p, str) for p in prompts) else all_ids()
    texts = [p if isinstance(p, str) else None for p in prompts]
    meta = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.model_name,
    }

    def chunk(choices: list[dict], usage: dict | None) -> dict:
        return {**meta, "choices": choices, "usage": usage}

    if body.max_tokens == 0:  # echo only: score the prompts, generate nothing
        outs = _echo_only_replies(engine, body, ids)
        if body.stream:
            return _echo_only_stream(engine, body, ids, texts, chunk)
    else:
        generated = await _generated_replies(engine, body, request, open_requests, ids, texts, chunk)
        if isinstance(generated, Response):
            return generated
        outs = generated

    scores = None
    if body.logprobs is not None:
        scores = await _score(
            engine,
            request,
            open_requests,
            [p + o.token_ids for p, o in zip(ids, outs)],
            body.logprobs,
            queue=body.max_tokens == 0,
        )  # a reply generated already must finish
        if scores is None:
            return Response(status_code=499)
    if scores is not None:  # in a worker thread: the texts and the JSON of long logprobs take a while
        return await asyncio.to_thread(_completion_reply, engine, body, meta, ids, texts, outs, scores)
    return _completion_reply(engine, body, meta, ids, texts, outs, scores)


def _completion_reply(
    engine: Any, body: CompletionBody, meta: dict, ids: list[list[int]], texts: list, outs: list, scores: list | None
) -> JSONResponse:
    """The JSON reply of /v1/completions: each prompt's choice (its echo, text and logprobs) and the usage."""
    choices = []
    for i, (p, out) in enumerate(zip(ids, outs)):
        text = _prompt_text(engine, texts[i], p) + out.text if body.echo else out.text
        logprobs = (
            None
            if scores is None
            else completion_logprobs(engine.tokenizer, scores[i], 0 if body.echo else len(p), body.logprobs)
        )
        choices.append(replies.completion_choice(text, out.finish_reason, index=i, logprobs=logprobs))
    usage = replies.usage_of(sum(map(len, ids)), sum(len(o.token_ids) for o in outs))
    return JSONResponse({**meta, "choices": choices, "usage": usage})


def _prompt_text(engine: Any, text: str | None, ids: list[int]) -> str:
    return text if text is not None else engine.tokenizer.decode(ids)


async def chat_completions(
    engine: Any, template: ChatTemplate, body: ChatCompletionBody, request: Request, open_requests
) -> Response:
    check_model(engine, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs \"logprobs\": true", param="top_logprobs", code="invalid_value")
    if body.logprobs and body.stream:
        raise APIError(
            400, "logprobs: cannot be streamed; send \"stream\": false", param="logprobs", code="invalid_value"
        )
    if body.logprobs:
        _scorer(engine, "logprobs")
    try:
        prompt = template.render([message.model_dump() for message in body.messages])
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
    prompt_ids = await run_in_threadpool(tokenize, engine, prompt, "messages")
    generation = prepare(
        engine,
        prompt_ids,
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        default_max_tokens=None,
        extra_stop=template.stop,
        param="messages",
    )
    if body.logprobs:
        check_logprobs_limit(engine, generation.max_tokens, body.top_logprobs or 0, "top_logprobs")
    [handle] = submit(engine, [generation], open_requests)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}

    if body.stream:

        def chunk(choices: list[dict], usage: dict | None) -> dict:
            return {**meta, "object": "chat.completion.chunk", "choices": choices, "usage": usage}

        events = replies.event_stream(
            handle, chunk, replies.chat_delta, first_choice=replies.chat_opening(), include_usage=body.include_usage
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=replies.SSE_HEADERS)

    outs = await replies.replies_or_hang_up(request, [handle])
    if outs is None:
        return Response(status_code=499)
    [out] = outs
    if failure := engine_failure(out.finish_reason):
        raise failure
    if not body.logprobs:
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion",
                "choices": [replies.chat_choice(out.text, out.finish_reason)],
                "usage": replies.usage(handle),
            }
        )
    scores = await _score(
        engine, request, open_requests, [prompt_ids + out.token_ids], body.top_logprobs or 0, queue=False
    )
    if scores is None:
        return Response(status_code=499)

    def reply() -> JSONResponse:  # in a worker thread, as for completions
        logprobs = chat_logprobs(engine.tokenizer, scores[0], len(prompt_ids), body.top_logprobs or 0)
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion",
                "choices": [replies.chat_choice(out.text, out.finish_reason, logprobs)],
                "usage": replies.usage(handle),
            }
        )

    return await asyncio.to_thread(reply)


__all__ = [
    "completions",
    "chat_completions",
    "check_model",
    "check_logprobs_limit",
    "check_request_tokens",
    "submit",
    "DEFAULT_COMPLETION_MAX_TOKENS",
]
