"""The token-level work of an lm-eval model, without lm-eval: what to score, in what batches, and how
a task's generation settings become engine requests.

    seq, n = scoring_sequence(context_ids, continuation_ids, max_length)   # left-truncated to fit
    for batch in length_batches(sequences, batch_size): ...                 # longest first, like lengths
    logprob, greedy = continuation_score(scores, n)                         # from a meshlm Scores
    request = generation_request(ids, gen_kwargs, context=..., default_max_tokens=256, seed=1234)

`max_length` is what lm-eval calls a model's max length: the tokens one forward takes in. A scored
sequence is one token longer (its last token is only predicted), so the scorer must take
`max_length + 1` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams


def scoring_sequence(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], int]:
    """(tokens to score, how many of their last tokens are the continuation). The context is cut from
    the left so that the forward takes at most `max_length` tokens; the continuation is never cut."""
    if len(continuation) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens does not fit in the model's {max_length}-token window"
        )
    whole = [*context, *continuation][-(max_length + 1) :]
    return [int(t) for t in whole], len(continuation)


def continuation_score(scores: Any, n: int) -> tuple[float, bool]:
    """(log p of the last `n` tokens given those before, whether each of them is the likeliest there)."""
    if n == 0:
        return 0.0, True
    return float(np.sum(scores.logprobs[-n:], dtype=np.float64)), bool(np.all(scores.greedy[-n:]))


def length_batches(sequences: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of `sequences` in batches of at most `batch_size`, longest first, so that a batch holds
    sequences of about one length (less padding, fewer compiled shapes) and a window too long for
    the devices fails at once rather than at the end."""
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), tuple(sequences[i])))
    return [order[at : at + batch_size] for at in range(0, len(order), batch_size)]


def stop_strings(until: Any) -> tuple[str, ...]:
    """lm-eval's `until` (a string, a list of strings or None) as the engine's stop strings."""
    if until is None:
        return ()
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise ValueError(f"generation_kwargs: `until` must be a string or a list of strings, got {until!r}")
    return tuple(dict.fromkeys(s for s in until if s))


def sampling_params(kwargs: dict, seed: int | None) -> SamplingParams:
    """A task's sampling settings: greedy unless it sets `do_sample: true` (then temperature 1 unless it
    says otherwise) or a temperature above 0; `top_k`, `top_p` as given."""
    do_sample = bool(kwargs.get("do_sample", False))
    temperature = kwargs.get("temperature")
    temperature = (1.0 if do_sample else 0.0) if temperature is None else float(temperature)
    if not do_sample and "do_sample" in kwargs:
        temperature = 0.0
    return SamplingParams(
        temperature=temperature,
        top_k=int(kwargs.get("top_k") or 0),
        top_p=float(kwargs.get("top_p") or 1.0),
        seed=seed if temperature > 0 else None,
    )


def generation_request(
    prompt: Sequence[int],
    gen_kwargs: dict,
    *,
    context: int,
    longest_prompt: int,
    default_max_tokens: int,
    seed: int | None,
    fallback_token: int,
) -> GenerationRequest:
    """The engine request for one `generate_until` request: at most `max_gen_toks` new tokens (the
    task's, else `default_max_tokens`), the prompt cut from the left to leave them room in `context`
    tokens (and to at most `longest_prompt`), stopping at `until`. An empty prompt is `fallback_token`."""
    kwargs = dict(gen_kwargs or {})
    max_tokens = int(kwargs.get("max_gen_toks") or kwargs.get("max_tokens") or default_max_tokens)
    max_tokens = max(1, min(max_tokens, context - 1))
    keep = min(context - max_tokens, longest_prompt)
    ids = [int(t) for t in prompt][-keep:] or [int(fallback_token)]
    return GenerationRequest(ids, max_tokens, sampling_params(kwargs, seed), stop_strings(kwargs.get("until")))


__all__ = [
    "scoring_sequence",
    "continuation_score",
    "length_batches",
    "stop_strings",
    "sampling_params",
    "generation_request",
]
