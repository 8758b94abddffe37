"""AdamW with linear warm-up and cosine decay, global-norm clipping, no weight decay on norms."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from meshlm.errors import UsageError


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    min_lr_ratio: float = 0.1  # the cosine ends at lr × this
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self):
        if self.lr <= 0:
            raise UsageError(f"--lr={self.lr} must be positive")
        if self.total_steps <= 0:
            raise UsageError(f"--steps={self.total_steps} must be positive")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup_steps={self.warmup_steps} must be ≥ 0")
        if self.clip_norm < 0 or self.weight_decay < 0:
            raise UsageError("--clip_norm and --weight_decay must be ≥ 0")


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Learning rate of the update that completes step `count + 1` (steps count from 1): linear warm-up
    lr/warmup, 2·lr/warmup, ..., lr; then cosine from lr (first step after warm-up) to lr × min_lr_ratio
    (the last step). Never 0, so every step trains."""
    warmup, total, peak, end = cfg.warmup_steps, cfg.total_steps, cfg.lr, cfg.lr * cfg.min_lr_ratio

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        warm = peak * step / max(warmup, 1)
        frac = jnp.clip((step - warmup - 1) / max(total - warmup - 1, 1), 0.0, 1.0)
        cosine = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        return jnp.where(step <= warmup, warm, cosine)

    return schedule


def decay_mask(params):
    """Decay matrices (kernels, embeddings), never RMSNorm scales: the leaf named `scale`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (the same empty state, the same arithmetic) that takes the norm the
    step has already computed, `update(..., grad_norm=norm)`, rather than reducing every gradient
    across the devices a second time. Without `grad_norm` it computes the norm itself. `max_norm` 0
    passes the updates through unchanged (no clipping)."""

    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        if max_norm <= 0:
            return updates, state
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        keep = jnp.squeeze(norm < max_norm)
        return jax.tree.map(lambda g: jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformationExtraArgs:
    """AdamW after global-norm clipping (none when `clip_norm` is 0). The state is (clip's empty state,
    AdamW's) whatever `clip_norm` is, so a run may resume with another --clip_norm. `update` takes
    `grad_norm=` (the norm of the gradients, when the caller has it) as an extra argument."""
    adamw = optax.adamw(
        lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    return optax.chain(clip_by_global_norm(cfg.clip_norm), adamw)


def from_unclipped(opt_state):
    """The optimizer state of a checkpoint written when `--clip_norm=0` left the clip out of the chain
    (AdamW's state alone), in today's layout."""
    return (optax.EmptyState(), opt_state)
