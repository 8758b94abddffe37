"""The HTTP API's replies in OpenAI's shapes: a whole reply, or a stream of server-sent events.

A whole reply waits for the engine's last event while watching the connection: a client that hangs
up has its request cancelled in the engine, which frees its batch slot at once. A stream sends one
chunk per engine event, an optional usage chunk, then `data: [DONE]`; a request the engine ends
without finishing it ends the stream with an error event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from fastapi import Request

from meshlm.serve.api.errors import engine_failure

log = logging.getLogger("meshlm.serve.api")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage(handle) -> dict[str, int]:
    prompt, completion = handle.prompt_tokens, handle.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(text: str, finish_reason: str | None, index: int = 0, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_delta(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish_reason}


def chat_opening() -> dict:
    """The first choice of a streamed chat reply: the assistant's role, no text yet."""
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


async def reply_or_hang_up(request: Request, handle) -> tuple[str, str] | None:
    """The whole reply and its finish reason; None if the client hung up first (the engine is told)."""
    replies = await replies_or_hang_up(request, [handle])
    return None if replies is None else (replies[0].text, replies[0].finish_reason)


@dataclass
class Reply:
    """One request's whole reply: its text, the tokens generated, why it ended."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


async def unless_hung_up(request: Request, work: Callable[[], Awaitable[object]]) -> bool:
    """Run `work()` while watching the connection: True once it is done, False (and `work` cancelled)
    if the client hung up first."""
    done = False

    async def cancel_on_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as outer:
        outer.start_soon(cancel_on_disconnect, outer.cancel_scope)
        await work()
        done = True
        outer.cancel_scope.cancel()
    return done


async def scores_or_hang_up(request: Request, handle) -> list | None:
    """The `Scores` of an engine's `ScoreHandle`; None if the client hung up first, in which case the
    engine drops the chunks still to score. An engine that ended it unscored raises its APIError."""
    try:
        if not await unless_hung_up(request, handle.wait):
            return None
    finally:
        if not handle.done:
            handle.cancel()
    if failure := engine_failure(handle.finish_reason):
        raise failure
    return handle.scores


async def replies_or_hang_up(request: Request, handles: list) -> list[Reply] | None:
    """The whole replies of requests running together (in order); None if the client hung up first,
    in which case every request still running is cancelled."""
    replies = [Reply() for _ in handles]

    async def collect(handle, reply: Reply) -> None:
        parts = []
        try:
            async for event in handle:
                parts.append(event.text)
                reply.token_ids += event.token_ids
                reply.finish_reason = event.finish_reason or reply.finish_reason
        finally:
            reply.text = "".join(parts)
            if reply.finish_reason is None:
                handle.cancel()

    async def collect_all() -> None:
        async with anyio.create_task_group() as tasks:
            for handle, reply in zip(handles, replies):
                tasks.start_soon(collect, handle, reply)

    await unless_hung_up(request, collect_all)
    return None if any(r.finish_reason is None for r in replies) else replies


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def fixed_stream(bodies: list[dict]) -> AsyncIterator[str]:
    """Server-sent events of bodies known in advance, then `[DONE]`."""
    for body in bodies:
        yield sse(body)
    yield sse("[DONE]")


async def event_stream(
    handle,
    chunk: Callable[[list[dict], dict | None], dict],
    choice: Callable[[str, str | None], dict],
    *,
    first_choice: dict | None = None,
    include_usage: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per engine event, an optional usage chunk, then `[DONE]`.

    `chunk(choices, usage)` makes an event's body; `choice(text, finish_reason)` one choice in it.

    Starlette stops iterating when the client disconnects; the `finally` then cancels the request.
    """
    finished = False
    try:
        if first_choice is not None:
            yield sse(chunk([first_choice], None))
        async for event in handle:
            finished = event.finish_reason is not None
            if failure := engine_failure(event.finish_reason):
                yield sse(failure.body())
                return
            if event.text or finished:
                yield sse(chunk([choice(event.text, event.finish_reason)], None))
        if include_usage:
            yield sse(chunk([], usage(handle)))
        yield sse("[DONE]")
    except Exception:
        log.exception("streaming a reply failed")
        yield sse(engine_failure("error").body())
    finally:
        if not finished:
            handle.cancel()


__all__ = [
    "SSE_HEADERS",
    "usage",
    "usage_of",
    "Reply",
    "replies_or_hang_up",
    "scores_or_hang_up",
    "unless_hung_up",
    "completion_choice",
    "chat_choice",
    "chat_delta",
    "chat_opening",
    "reply_or_hang_up",
    "sse",
    "event_stream",
    "fixed_stream",
]
