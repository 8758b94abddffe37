"""Evaluation during training: one jitted forward-only step (no gradients) over fixed batches.

    evaluator = Evaluator(placement, eval_batches, perm)   # eval_batches: meshlm.data.EvalBatches
    result = evaluator(state.params)   # {"eval_loss": ..., "eval_perplexity": ..., "eval_tokens": ..., ...}

The eval step takes the parameters in the train step's layout and a batch in the train step's batch
layout, and adds the batch's (sum of token losses, token count) to a running pair on the devices; the
evaluation reads the pair back once, after its last batch, so it costs one host round trip. The loss is
the training loss (`meshlm.train.step.loss_sums`: mean token cross-entropy in float32 over the tokens
whose `loss_mask` is 1), the perplexity its exponential. Every batch has the same shapes, so the step
compiles once, at the first evaluation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import sharding
from meshlm.models.placement import Placement
from meshlm.train.step import BATCH_KEYS, loss_sums, program_options, put_batch, ring_order


def make_eval_step(placement: Placement) -> Callable:
    """`eval_step(params, batch, (nll, count)) -> (nll + batch nll, count + batch tokens)`, jitted with the
    train step's parameter and batch shardings."""

    def eval_step(params, batch, totals):
        with sharding.token_order(ring_order(placement)):  # batches laid out by `put_batch` with the permutation
            nll, count = loss_sums(placement, params, batch)
        return totals[0] + nll.astype(jnp.float32), totals[1] + count.astype(jnp.float32)

    rows = sharding.batch_sharding(placement.mesh, placement.strategy)
    replicated = sharding.replicated(placement.mesh)
    return jax.jit(
        eval_step,
        in_shardings=(placement.shardings, {k: rows for k in BATCH_KEYS}, (replicated, replicated)),
        out_shardings=(replicated, replicated),
        compiler_options=program_options(placement),
    )


class Evaluator:
    """Runs the eval step over every evaluation batch of this process and returns the metrics."""

    def __init__(self, placement: Placement, eval_batches, perm: np.ndarray | None = None):
        self.placement, self.eval_batches, self.perm = placement, eval_batches, perm
        self.step_fn = make_eval_step(placement)
        self._zeros = jax.device_put((np.float32(0), np.float32(0)), sharding.replicated(placement.mesh))
        self._device_batches: list[dict] | None = None

    @property
    def n_batches(self) -> int:
        return self.eval_batches.n_batches

    def _batches(self) -> list[dict]:
        if self._device_batches is None:  # the same rows every time: laid out on the mesh once
            self._device_batches = [put_batch(self.placement, b, self.perm) for b in self.eval_batches.batches()]
        return self._device_batches

    def __call__(self, params: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        totals = self._zeros
        for batch in self._batches():
            totals = self.step_fn(params, batch, totals)
        nll, count = (float(x) for x in jax.device_get(totals))  # the evaluation's one host round trip
        loss = nll / max(count, 1.0)
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_tokens": int(count),
            "eval_batches": self.n_batches,
            "eval_seconds": time.perf_counter() - t0,
        }


def eval_steps(every: int | None, total_steps: int) -> Callable[[int], bool]:
    """`due(step)`: evaluate every `every` steps (default: a tenth of the run) and after the last step."""
    every = every or max(1, total_steps // 10)
    return lambda step: step % every == 0 or step == total_steps


__all__ = ["make_eval_step", "Evaluator", "eval_steps"]
