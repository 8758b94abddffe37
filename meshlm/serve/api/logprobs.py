"""Log-probabilities in OpenAI's shapes, from `meshlm.serve.engine.scoring.Scores`.

Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry
per token shown (the prompt's too with `echo`). A token is its own text, decoded alone; an entry of
`top_logprobs` maps the k likeliest tokens' texts to their log-probabilities, plus the token itself
when it is not among them (so up to k + 1 entries, as OpenAI does). The first token of a sequence has
no log-probability: null, and null alternatives. `text_offset` is where each token starts in the
choice's `text`.

Chat (`logprobs: true, top_logprobs: k`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]}` for the generated tokens.
"""

from __future__ import annotations

from typing import Any

from meshlm.serve.engine.scoring import Scores
from meshlm.serve.engine.text import IncrementalText


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([int(token)])


def text_offsets(tokenizer: Any, ids: list[int]) -> list[int]:
    """Where each token's text starts in the text of `ids` (decoded together), in linear time: the
    length of the text before it (bytes of an unfinished character count as one U+FFFD each)."""
    text, offsets, settled = IncrementalText(tokenizer), [], 0
    for token in ids:
        pending = text.unsettled
        offsets.append(settled + (len(tokenizer.decode(pending)) if pending else 0))
        settled += len(text.add(int(token)))
    return offsets


def _alternatives(tokenizer: Any, scores: Scores, i: int, top: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for token, logprob in zip(scores.top_ids[i, :top], scores.top_logprobs[i, :top]):
        out.setdefault(token_text(tokenizer, token), float(logprob))
    out.setdefault(token_text(tokenizer, scores.token_ids[i]), float(scores.logprobs[i]))
    return out


def completion_logprobs(tokenizer: Any, scores: Scores, first: int, top: int) -> dict:
    """OpenAI's completion `logprobs` object for tokens[first:] of a scored sequence."""
    ids = [int(t) for t in scores.token_ids[first:]]
    tokens, token_logprobs, tops = [], [], []
    for i in range(first, len(scores.token_ids)):
        tokens.append(token_text(tokenizer, scores.token_ids[i]))
        if i == 0:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(float(scores.logprobs[i]))
            tops.append(_alternatives(tokenizer, scores, i, top))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": text_offsets(tokenizer, ids),
    }


def _entry(tokenizer: Any, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, scores: Scores, first: int, top: int) -> dict:
    """OpenAI's chat `logprobs` object for tokens[first:] (first >= 1) of a scored sequence."""
    content = []
    for i in range(max(first, 1), len(scores.token_ids)):
        entry = _entry(tokenizer, scores.token_ids[i], scores.logprobs[i])
        entry["top_logprobs"] = [
            _entry(tokenizer, t, lp) for t, lp in zip(scores.top_ids[i, :top], scores.top_logprobs[i, :top])
        ]
        content.append(entry)
    return {"content": content}


__all__ = ["completion_logprobs", "chat_logprobs", "text_offsets", "token_text"]
