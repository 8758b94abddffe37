"""Prompts to engine requests: tokenizing (a prompt far over the context is refused before it is
tokenized) and the checks that prompt + max_tokens fit in the context, all before anything is queued.

A string prompt longer than the context times the longest text any one token decodes to cannot fit
whatever it tokenizes to: it is refused by its length in characters alone, so an oversized prompt
costs the server no tokenizing.
"""

from __future__ import annotations

import functools
from typing import Any

from meshlm.serve.api.errors import APIError
from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams


@functools.lru_cache(maxsize=8)
def longest_token_text(tokenizer: Any) -> int | None:
    """The most characters one token decodes to (None when the tokenizer does not say its size)."""
    vocab = getattr(tokenizer, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        return None
    try:
        return max(1, max(len(tokenizer.decode([i])) for i in range(vocab)))
    except Exception:  # noqa: BLE001  (a tokenizer that cannot decode some id alone: no cheap bound)
        return None


def tokenize(engine: Any, text: str, param: str) -> list[int]:
    """The token ids of a prompt, refused (400) without tokenizing when it is too long to fit."""
    context = engine.max_seq_len
    longest = longest_token_text(engine.tokenizer)
    if longest is not None and len(text) > context * longest:
        raise APIError(
            400,
            f"the prompt is {len(text)} characters, more than the context of {context} tokens "
            f"can hold (at most {context * longest}); shorten it",
            param=param,
            code="context_length_exceeded",
        )
    return engine.tokenizer.encode(text)


def check_fits(engine: Any, prompt_ids: list[int], param: str, room_needed: int = 1) -> int:
    """The room left after the prompt; 400 if the prompt is empty or leaves less than `room_needed`."""
    context, prompt_len = engine.max_seq_len, len(prompt_ids)
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
    room = context - prompt_len
    if room < room_needed:
        leave = ", leaving room for the reply" if room_needed else ""
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens, and the context is {context} tokens: "
            f"shorten it to at most {context - room_needed} tokens{leave}",
            param=param,
            code="context_length_exceeded",
        )
    return room


def check_token_ids(engine: Any, prompt_ids: list[int], param: str) -> None:
    vocab = engine.model.cfg.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param, code="invalid_value")


def prepare(
    engine: Any,
    prompt_ids: list[int],
    body: Any,
    *,
    max_tokens: int | None,
    default_max_tokens: int | None,
    extra_stop: tuple[str, ...] = (),
    param: str = "prompt",
) -> GenerationRequest:
    """The engine request for one prompt, once prompt + max_tokens are known to fit in the context.

    `max_tokens` None asks for `default_max_tokens`, or for the rest of the context when that is None too.
    """
    room = check_fits(engine, prompt_ids, param)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(
            400,
            f"max_tokens: {max_tokens} new tokens after the prompt's {len(prompt_ids)} exceed the "
            f"context of {engine.max_seq_len} tokens; ask for at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=body.stop + extra_stop,
            ignore_eos=body.ignore_eos,
        )
        engine.check(request)
    except ValueError as e:  # what the checks above could not know, as the engine words it
        raise APIError(400, str(e), param=param, code="invalid_value") from e
    return request


__all__ = ["tokenize", "check_fits", "check_token_ids", "prepare", "longest_token_text"]
