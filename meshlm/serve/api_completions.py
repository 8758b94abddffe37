"""The two generation endpoints' work: `/v1/completions` and `/v1/chat/completions`.

Completions take one prompt or a batch (strings or token ids): every prompt is checked first, then all
are queued at once, so they run together in the engine's batch, and the choices come back in prompt
order (`index`). With `echo` a choice's text starts with its prompt; `max_tokens: 0` with `echo` only
scores the prompt. `logprobs` (and chat's `logprobs`/`top_logprobs`) are the model's own, computed by
one batched forward over each prompt and the tokens generated for it (meshlm.serve.scoring), after
generation: the engine's decode step stays as fast as without them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshlm.serve import api_replies as replies
from meshlm.serve.api_errors import APIError, engine_failure
from meshlm.serve.api_logprobs import chat_logprobs, completion_logprobs
from meshlm.serve.api_prompts import check_fits, check_token_ids, prepare, tokenize
from meshlm.serve.api_schemas import ChatCompletionBody, CompletionBody, GenerationBody
from meshlm.serve.chat import ChatTemplate, ChatTemplateError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def check_model(engine: Any, body: GenerationBody) -> None:
    if body.model is not None and body.model != engine.model_name:
        raise APIError(400, f"model: this server serves {engine.model_name!r}, not {body.model!r}",
                       param="model", code="model_not_found")


def _scorer(engine: Any, param: str):
    try:
        return engine.scorer()
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from e


async def _score(engine: Any, param: str, sequences: list[list[int]], top: int):
    scorer = _scorer(engine, param)
    return await run_in_threadpool(scorer.score, sequences, top)


def _prompt_ids(engine: Any, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        return tokenize(engine, prompt, param)
    check_token_ids(engine, prompt, param)
    return prompt


async def completions(engine: Any, body: CompletionBody, request: Request, open_requests) -> Response:
    check_model(engine, body)
    prompts, several = body.prompt, len(body.prompt) > 1
    if body.stream and (several or body.logprobs is not None):
        what = "a list of several prompts" if several else "logprobs"
        raise APIError(400, f"{'prompt' if several else 'logprobs'}: {what} cannot be streamed; send \"stream\": false",
                       param="prompt" if several else "logprobs", code="invalid_value")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: 0 generates nothing; ask for at least 1, or set \"echo\": true to score "
                            "the prompt", param="max_tokens", code="invalid_value")
    if body.logprobs is not None:
        _scorer(engine, "logprobs")  # refused before any work where scoring is not available

    def all_ids() -> list[list[int]]:
        return [_prompt_ids(engine, p, "prompt") for p in prompts]

    ids = await run_in_threadpool(all_ids) if any(isinstance(p, str) for p in prompts) else all_ids()
    texts = [p if isinstance(p, str) else None for p in prompts]
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": engine.model_name}

    if body.max_tokens == 0:  # echo only: score the prompts, generate nothing
        for p in ids:
            check_fits(engine, p, "prompt", room_needed=0)
        outs = [replies.Reply("", [], "length") for _ in ids]
    else:
        requests = [prepare(engine, p, body, max_tokens=body.max_tokens,
                            default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS) for p in ids]
        handles = [engine.submit(r) for r in requests]  # all queued together: one batch in the engine
        open_requests.update(handles)
        if body.stream:
            echo = replies.completion_choice(_prompt_text(engine, texts[0], ids[0]), None) if body.echo else None

            def chunk(choices: list[dict], usage: dict | None) -> dict:
                return {**meta, "choices": choices, "usage": usage}

            events = replies.event_stream(handles[0], chunk, replies.completion_choice, first_choice=echo,
                                          include_usage=body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=replies.SSE_HEADERS)
        outs = await replies.replies_or_hang_up(request, handles)
        if outs is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        for out in outs:
            if failure := engine_failure(out.finish_reason):
                raise failure

    scores = None
    if body.logprobs is not None:
        scores = await _score(engine, "logprobs", [p + o.token_ids for p, o in zip(ids, outs)], body.logprobs)
    choices = []
    for i, (p, out) in enumerate(zip(ids, outs)):
        text = _prompt_text(engine, texts[i], p) + out.text if body.echo else out.text
        logprobs = None if scores is None else completion_logprobs(
            engine.tokenizer, scores[i], 0 if body.echo else len(p), body.logprobs)
        choices.append(replies.completion_choice(text, out.finish_reason, index=i, logprobs=logprobs))
    usage = replies.usage_of(sum(map(len, ids)), sum(len(o.token_ids) for o in outs))
    return JSONResponse({**meta, "choices": choices, "usage": usage})


def _prompt_text(engine: Any, text: str | None, ids: list[int]) -> str:
    return text if text is not None else engine.tokenizer.decode(ids)


async def chat_completions(engine: Any, template: ChatTemplate, body: ChatCompletionBody, request: Request,
                           open_requests) -> Response:
    check_model(engine, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs \"logprobs\": true", param="top_logprobs", code="invalid_value")
    if body.logprobs and body.stream:
        raise APIError(400, "logprobs: cannot be streamed; send \"stream\": false", param="logprobs",
                       code="invalid_value")
    if body.logprobs:
        _scorer(engine, "logprobs")
    try:
        prompt = template.render([message.model_dump() for message in body.messages])
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
    prompt_ids = await run_in_threadpool(tokenize, engine, prompt, "messages")
    generation = prepare(engine, prompt_ids, body, max_tokens=body.max_completion_tokens or body.max_tokens,
                         default_max_tokens=None, extra_stop=template.stop, param="messages")
    handle = engine.submit(generation)
    open_requests.add(handle)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}

    if body.stream:
        def chunk(choices: list[dict], usage: dict | None) -> dict:
            return {**meta, "object": "chat.completion.chunk", "choices": choices, "usage": usage}

        events = replies.event_stream(handle, chunk, replies.chat_delta, first_choice=replies.chat_opening(),
                                      include_usage=body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=replies.SSE_HEADERS)

    outs = await replies.replies_or_hang_up(request, [handle])
    if outs is None:
        return Response(status_code=499)
    [out] = outs
    if failure := engine_failure(out.finish_reason):
        raise failure
    logprobs = None
    if body.logprobs:
        [scores] = await _score(engine, "logprobs", [prompt_ids + out.token_ids], body.top_logprobs or 0)
        logprobs = chat_logprobs(engine.tokenizer, scores, len(prompt_ids), body.top_logprobs or 0)
    return JSONResponse({**meta, "object": "chat.completion",
                         "choices": [replies.chat_choice(out.text, out.finish_reason, logprobs)],
                         "usage": replies.usage(handle)})


__all__ = ["completions", "chat_completions", "check_model", "DEFAULT_COMPLETION_MAX_TOKENS"]
