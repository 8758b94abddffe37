"""What a server admits at once: the default limits `meshlm serve` sets on its engine, and the error
for a full queue (plain constants, importable without JAX).

    MAX_QUEUE           prompts (and sequences to score) waiting for the engine at once
    MAX_REQUEST_TOKENS  new tokens one request of several prompts may ask for in all (prompts × max_tokens)
    MAX_LOGPROBS        log-probabilities one request may return: tokens shown × (alternatives + 1)
    SCORE_CHUNK_TOKENS  padded tokens of one scoring forward the engine runs between two decode steps
"""

from __future__ import annotations

MAX_QUEUE = 1024
MAX_REQUEST_TOKENS = 32_768
MAX_LOGPROBS = 100_000
SCORE_CHUNK_TOKENS = 2048


class QueueFull(Exception):
    """The engine's queue holds `max_queue` prompts already: retry later (the HTTP API answers 429)."""


__all__ = ["MAX_QUEUE", "MAX_REQUEST_TOKENS", "MAX_LOGPROBS", "SCORE_CHUNK_TOKENS", "QueueFull"]
