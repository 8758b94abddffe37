"""Log-probabilities of given token sequences: every token's, and the likeliest alternatives at each position.

    scorer = Scorer.from_model(model)                    # a LoadedModel (meshlm.serve.loading), weights stacked
    scorer = Scorer.from_engine(engine)                  # or the weights a running Engine holds (no copy)
    [s] = scorer.score([[5, 17, 99, 3]], top=5)
    s.logprobs        # [4] float32: log p(token i | tokens before it); logprobs[0] is nan (nothing precedes it)
    s.top_ids         # [4, 5] int32: the 5 likeliest tokens at position i (row 0: -1)
    s.top_logprobs    # [4, 5] float32, descending (row 0: nan)
    s.greedy          # [4] bool: token i is the likeliest there (row 0: False)
    s.next_top_ids, s.next_top_logprobs    # [5]: the likeliest tokens after the last one

One jitted forward per (rows, length) bucket; the head runs over a chunk of positions at a time. A
server scores through its engine (`Engine.submit_scores`), a group of sequences (`chunks`) between
two decode steps (`score_chunk`). Buckets and chunks: docs/serve.md, "Inside the server".
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshlm import sharding
from meshlm.serve.engine.shapes import length_buckets

MAX_TOP = 20  # alternatives computed at every position; `top` asks for up to this many
HEAD_CHUNK = 128  # positions whose logits are computed at once


@dataclass(frozen=True)
class Scores:
    """One sequence's log-probabilities (see the module's docstring)."""

    token_ids: np.ndarray  # [n] int32
    logprobs: np.ndarray  # [n] float32, logprobs[0] nan
    top_ids: np.ndarray  # [n, top] int32, row 0 -1
    top_logprobs: np.ndarray  # [n, top] float32, row 0 nan
    greedy: np.ndarray  # [n] bool, row 0 False
    next_top_ids: np.ndarray  # [top] int32
    next_top_logprobs: np.ndarray  # [top] float32

    def total(self, start: int = 1) -> float:
        """The log-probability of tokens[start:] given tokens[:start] (start >= 1)."""
        return float(np.sum(self.logprobs[max(start, 1) :], dtype=np.float64))


class Scorer:
    """Scores token sequences with a model's weights on its mesh. Thread-safe.

    `params` is either the model's parameter tree (`LoadedModel.params`, layers stacked) or the engine's
    (other weights, one tree per layer), as `meshlm.serve.engine.steps.split_layers` makes it. Sequences may
    be up to `max_len` tokens; `max_batch` rows run at once."""

    def __init__(self, placement: Any, params: Any, *, max_len: int, max_batch: int = 8):
        if getattr(placement, "groups", None):
            raise ValueError("per-layer-range strategies ([[layers]]) are for training; score with one strategy")
        self.placement, self.params = placement, params
        self.mesh, self.cfg = placement.mesh, placement.cfg
        self.max_len = int(max_len)
        data = sharding.data_parallel_size(self.mesh, placement.strategy)
        rows, n = [], data
        while True:
            rows.append(n)
            if n >= max_batch:
                break
            n *= 2
        self.row_buckets, self.length_buckets = tuple(rows), length_buckets(self.max_len)
        self.top = min(MAX_TOP, self.cfg.vocab_size)
        self._forward = jax.jit(self._forward_fn)
        self._lock = threading.Lock()

    @classmethod
    def from_model(cls, model: Any, *, max_len: int | None = None, max_batch: int = 8) -> Scorer:
        """For a `LoadedModel` (meshlm.serve.loading.load_model or random_model)."""
        return cls(model.placement, model.params, max_len=max_len or model.cfg.max_seq_len, max_batch=max_batch)

    @classmethod
    def from_engine(cls, engine: Any) -> Scorer:
        """For the weights a running `Engine` holds, sequences up to its context, its `max_batch` rows."""
        return cls(engine.steps.placement, engine.steps.params, max_len=engine.max_seq_len, max_batch=engine.max_batch)

    def compiled_shapes(self) -> int:
        return self._forward._cache_size()

    def check(self, sequences: Sequence[Sequence[int]]) -> None:
        """ValueError for a sequence this scorer cannot take."""
        vocab = self.cfg.vocab_size
        for i, seq in enumerate(sequences):
            if len(seq) == 0:
                raise ValueError(f"sequence {i} is empty")
            if len(seq) > self.max_len:
                raise ValueError(f"sequence {i} has {len(seq)} tokens; at most {self.max_len} can be scored")
            if any(not 0 <= int(t) < vocab for t in seq):
                raise ValueError(f"sequence {i}: token ids must be in [0, {vocab})")

    def score(self, sequences: Sequence[Sequence[int]], top: int = 0) -> list[Scores]:
        """The `Scores` of each sequence, in order, with the `top` likeliest alternatives (0..MAX_TOP)."""
        if not 0 <= top <= self.top:
            raise ValueError(f"top must be in [0, {self.top}], got {top}")
        self.check(sequences)
        out: list[Scores] = []
        biggest = self.row_buckets[-1]
        for at in range(0, len(sequences), biggest):
            out += self.score_chunk([list(map(int, s)) for s in sequences[at : at + biggest]], top)
        return out

    def bucket(self, group: Sequence[Sequence[int]]) -> tuple[int, int]:
        """The (rows, length) that one forward over `group` (at most the biggest row bucket) pads to."""
        rows = next(r for r in self.row_buckets if r >= len(group))
        return rows, next(n for n in self.length_buckets if n >= max(map(len, group)))

    def chunks(self, sequences: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """The indices of `sequences` in groups of one forward each, every group at most `max_tokens`
        padded tokens (rows × length bucket) or a single sequence; sequences of similar length together."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        groups: list[list[int]] = []
        for i in order:
            group = groups[-1] + [i] if groups else None
            if (
                group is not None
                and len(group) <= self.row_buckets[-1]
                and (math.prod(self.bucket([sequences[j] for j in group])) <= max_tokens)
            ):
                groups[-1] = group
            else:
                groups.append([i])
        return groups

    def score_into(self, handle: Any, chunk: list[int]) -> tuple:
        """Score the sequences `chunk` indexes of a `ScoreHandle` (meshlm/serve/engine/request.py) into its
        `scores`, finishing it when no chunk is left; the shape run, ("score", rows, length)."""
        group = [handle.sequences[i] for i in chunk]
        for i, s in zip(chunk, self.score_chunk(group, handle.top)):
            handle.scores[i] = s
        if not handle.chunks:
            handle._finish("scored")
        return ("score", *self.bucket(group))

    def score_chunk(self, group: list[list[int]], top: int) -> list[Scores]:
        """The `Scores` of up to the biggest row bucket of checked sequences, by one forward."""
        rows, length = self.bucket(group)
        tokens = np.zeros((rows, length), np.int32)
        for i, seq in enumerate(group):
            tokens[i, : len(seq)] = seq
        with self._lock:  # one forward at a time: they would only compete for the same devices
            picked, ids, values = jax.device_get(self._forward(self.params, tokens))
        out = []
        for i, seq in enumerate(group):
            n = len(seq)
            logprobs = np.concatenate([[np.nan], picked[i, : n - 1]]).astype(np.float32)
            top_ids = np.concatenate([np.full((1, top), -1, np.int32), ids[i, : n - 1, :top]])
            top_lp = np.concatenate([np.full((1, top), np.nan, np.float32), values[i, : n - 1, :top]])
            greedy = np.concatenate([[False], ids[i, : n - 1, 0] == np.asarray(seq[1:], np.int32)])
            out.append(
                Scores(
                    np.asarray(seq, np.int32),
                    logprobs,
                    top_ids,
                    top_lp,
                    greedy,
                    ids[i, n - 1, :top].copy(),
                    values[i, n - 1, :top].copy(),
                )
            )
        return out

    def _forward_fn(self, params, tokens):
        """tokens [B, T] -> (log p of the next token [B, T], top ids [B, T, K], their log p [B, T, K]),
        entry t about the distribution after tokens[:, :t + 1] (the last picked entry is meaningless)."""
        B, T = tokens.shape
        placement = self.placement
        with sharding.activate(self.mesh, placement.strategy):
            if isinstance(params, tuple):  # the engine's: other weights, one tree per layer
                rest, layers = params
                model = nnx.merge(placement.graphdef, {**rest, "layers": layers[0]})
                x, positions = model.embed_tokens(tokens)
                for block in model.blocks(layers):
                    x, _ = block(x, positions, None)
            else:
                model = nnx.merge(placement.graphdef, params)
                x, positions = model.embed_tokens(tokens)
                x, _ = model.run_layers(x, positions)
            chunk = math.gcd(T, HEAD_CHUNK)
            following = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
            xs = x.reshape(B, T // chunk, chunk, -1).swapaxes(0, 1)
            targets = following.reshape(B, T // chunk, chunk).swapaxes(0, 1)

            def head(args):
                xc, tc = args
                logits = model.head(xc)  # [B, chunk, V] float32
                norm = jax.nn.logsumexp(logits, axis=-1)
                picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0] - norm
                values, ids = jax.lax.top_k(logits, self.top)
                return picked, ids.astype(jnp.int32), values - norm[..., None]

            picked, ids, values = jax.lax.map(head, (xs, targets))
        merge = lambda a: a.swapaxes(0, 1).reshape(B, T, *a.shape[3:])  # noqa: E731
        return merge(picked), merge(ids), merge(values)


__all__ = ["Scorer", "Scores", "MAX_TOP"]
