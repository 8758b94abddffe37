"""Diagnostics inside the training loop: the first step whose loss or gradient norm is NaN/Inf, and a
jax.profiler trace of chosen steps (`--profile_steps=A:B`).

`NonFiniteWatch` adds no host sync to a step: each step folds the step's loss and gradient norm into
a small device array (one tiny asynchronous computation); the loop reads it only where it reads the
device anyway, at log steps and before a checkpoint is saved, so no checkpoint ever holds the weights
of a step that went NaN.

What caused it decides the advice (`NonFinite.cause`, `meshlm.train.report.diverged`): weights that were
not finite when the run started, a batch with token ids outside the vocabulary, a loss that was not finite at
the run's first step (computed before any update), or finite steps and then not: only the last is the
learning rate's doing.

`StepProfiler` starts the trace before step A and stops it after step B (or when the loop ends first),
in `<run>/profile/`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import UsageError
from meshlm.ops import kernels


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first step whose loss or gradient norm was not finite, their values there, and what else the run
    knows at that point: its first step, whether the weights it started from were finite, and the first
    batch (step, id) that held a token id outside the model's vocabulary."""

    step: int
    loss: float
    grad_norm: float
    weights: bool = False  # the weights went NaN/Inf while the loss and gradient norm stayed finite
    first_step: int | None = None  # this run's first step (None: not known)
    start_weights_finite: bool = True  # the weights this run started from (fresh, restored or --init_from)
    bad_ids: tuple[int, int] | None = None  # (step, id): the first batch with an id outside [0, vocab_size)
    vocab_size: int | None = None

    def what(self) -> str:
        if self.weights:
            return "the weights became NaN/Inf"
        bad = [
            f"{name} became {value}"
            for name, value in (("the loss", self.loss), ("the gradient norm", self.grad_norm))
            if not math.isfinite(value)
        ]
        return " and ".join(bad)

    def cause(self) -> str:
        """What the run knows caused it: "weights" (the weights it started from were not finite), "data" (a
        batch held ids outside the vocabulary), "first step" (the run's first step, before any update: not
        the learning rate), or "training" (finite steps, then not: the learning rate or the gradients)."""
        if not self.start_weights_finite:
            return "weights"
        if self.bad_ids is not None:
            return "data"
        if not self.weights and self.step == self.first_step:
            return "first step"
        return "training"


class NonFiniteWatch:
    """Remembers, on the device, the first step with a NaN/Inf loss or gradient norm (see the module
    docstring); with `vocab_size`, also the first host batch with a token id outside the vocabulary."""

    def __init__(self, vocab_size: int | None = None):
        def fold(seen, step, loss, grad_norm):
            loss, grad_norm = loss.astype(jnp.float32), grad_norm.astype(jnp.float32)
            bad = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
            new = jnp.stack([step.astype(jnp.float32), loss, grad_norm])
            return jnp.where((seen[0] == 0) & bad, new, seen)

        self._fold = jax.jit(fold)
        self._all_finite = jax.jit(
            lambda tree: jnp.all(
                jnp.stack(
                    [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
                )
            )
        )
        self._seen = None
        self._zeros = lambda: jnp.zeros(3, jnp.float32)
        self.vocab_size, self.bad_ids = vocab_size, None
        self._first_step, self._start_finite = None, None

    def start(self, first_step: int, params) -> None:
        """The run's first step and the weights it starts from, whose finiteness is computed on the device
        now (before the first step donates them) and read only if a step goes bad."""
        self._first_step, self._start_finite = first_step, self._all_finite(params)

    def observe(self, step: int, metrics: dict, batch: dict | None = None) -> None:
        """Fold one step's metrics in (asynchronous: nothing waits for the step to finish). `batch`: the
        step's host batch, whose ids are checked against `vocab_size` (a min and a max on the host)."""
        if batch is not None and self.vocab_size is not None and self.bad_ids is None:
            for ids in (batch["inputs"], batch["targets"][:, -1]):  # every id of the rows, read once
                low, high = int(ids.min()), int(ids.max())
                if low < 0 or high >= self.vocab_size:
                    self.bad_ids = (step, low if low < 0 else high)
                    break
        if "grad_norm" not in metrics:
            return
        seen = self._seen if self._seen is not None else self._zeros()
        self._seen = self._fold(seen, np.int32(step), metrics["loss"], metrics["grad_norm"])

    def check(self, step: int, params=None) -> NonFinite | None:
        """The first bad step seen so far, or None (waits for the steps observed so far). With `params`
        (before a save), weights that are not all finite after `step` are bad too."""
        bad = None
        if self._seen is not None:
            first, loss, grad_norm = (float(v) for v in jax.device_get(self._seen))
            if first:
                bad = NonFinite(int(first), loss, grad_norm)
        if bad is None and params is not None and not bool(jax.device_get(self._all_finite(params))):
            bad = NonFinite(step, math.nan, math.nan, weights=True)
        if bad is None:
            return None
        start_finite = True if self._start_finite is None else bool(jax.device_get(self._start_finite))
        ids = self.bad_ids if self.bad_ids is not None and self.bad_ids[0] <= bad.step else None
        return dataclasses.replace(
            bad, first_step=self._first_step, start_weights_finite=start_finite, bad_ids=ids, vocab_size=self.vocab_size
        )


class StepProfiler:
    """A jax.profiler trace of steps `first`..`last` into `directory` (nothing when `steps` is None)."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path, enabled: bool = True):
        self.steps, self.directory, self.enabled = steps, Path(directory), enabled and steps is not None
        self.active = False

    def before(self, step: int, first_step: int) -> str | None:
        """Start tracing when `step` is the first profiled step this run reaches; the line to log, or None."""
        if not self.enabled or self.active or step > self.steps[1] or step != max(self.steps[0], first_step):
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))
        self.active = True
        return f"profiling steps {step}..{self.steps[1]} into {self.directory}"

    def after(self, step: int, state) -> str | None:
        """Stop after the last profiled step (waiting for it to finish); the line to log, or None."""
        if not self.active or step < self.steps[1]:
            return None
        jax.block_until_ready(state)
        return self.close()

    def close(self) -> str | None:
        """Stop a trace still running (the loop ended early); the line naming the trace file."""
        if not self.active:
            return None
        jax.profiler.stop_trace()
        self.active = False
        traces = sorted(self.directory.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        where = traces[-1] if traces else self.directory
        return (
            f"profile written to {where} (open {self.directory} in TensorBoard's profile tab, or the trace in Perfetto)"
        )


class DocumentsWatch:
    """Warns once when a batch has a row with more documents than cuDNN's packed attention keeps apart
    (`--model.max_documents`: the documents from that one on attend to each other), where the job runs
    that kernel (GPU, Hopper or later, length not split over sp). Reads the host batch: the last segment
    id of a row is its number of documents."""

    def __init__(self, model_cfg, policy, seq_len: int, *, ring: bool, platform: str, gpu_capability: float | None):
        call = kernels.Call(platform=platform, q_len=seq_len, kv_len=seq_len, head_dim=model_cfg.head_dim,
                            dtype=policy.dtype, packed=True, causal=True, gpu_capability=gpu_capability)  # fmt: skip
        try:
            chosen = kernels.choose(policy.attention, call)
        except UsageError:  # a kernel forced for packed rows that cannot serve them: the step says so
            chosen = None
        self.limit = policy.max_documents if chosen == "cudnn" and not ring else None
        self.warned = False

    def check(self, batch: dict) -> str | None:
        """The warning for this host batch, the first time one is due; else None."""
        if self.limit is None or self.warned:
            return None
        documents = int(batch["segment_ids"][:, -1].max())
        if documents <= self.limit:
            return None
        self.warned = True
        return (
            f"warning: a row holds {documents} documents, more than --model.max_documents={self.limit}: "
            f"cuDNN's packed attention lets its documents from number {self.limit} on attend to each other; "
            f"raise --model.max_documents (its workspace grows with it) or use --attention=triton"
        )


__all__ = ["NonFinite", "NonFiniteWatch", "StepProfiler", "DocumentsWatch"]
