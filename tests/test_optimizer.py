"""`meshlm.optimizer`: the clip that takes the step's gradient norm is optax's clip, state and arithmetic.

The train step computes the norm once (`sharding.global_norm`) and hands it to the optimizer; the
optimizer state keeps optax's structure, so checkpoints written before read back unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshlm.optimizer import OptimizerConfig, clip_by_global_norm, decay_mask, lr_schedule, make_optimizer


def _optax_reference(cfg: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else optax.identity(), adamw)


@pytest.mark.parametrize("clip_norm", [0.0, 0.5, 1e3])  # off, clipping, not clipping
def test_updates_and_state_are_optax_clip_and_adamw(clip_norm):
    rng = np.random.default_rng(0)
    params = {
        "w": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)},
        "norm": {"scale": jnp.ones(3, jnp.float32)},
    }
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    cfg = OptimizerConfig(clip_norm=clip_norm, warmup_steps=1)
    ours, ref = make_optimizer(cfg), _optax_reference(cfg)
    state, ref_state = ours.init(params), ref.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    want, _ = ref.update(grads, ref_state, params)
    for extra in ({}, {"grad_norm": optax.tree.norm(grads)}):
        got, _ = ours.update(grads, state, params, **extra)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), got, want)


def test_the_clip_uses_the_norm_it_is_given():
    grads = {"kernel": jnp.full((2, 2), 3.0)}  # its own norm: 6
    clip = clip_by_global_norm(1.0)
    state = clip.init(grads)
    np.testing.assert_allclose(clip.update(grads, state, grad_norm=jnp.float32(12.0))[0]["kernel"], 3.0 / 12.0)
    np.testing.assert_allclose(clip.update(grads, state, grad_norm=jnp.float32(0.5))[0]["kernel"], 3.0)
    np.testing.assert_allclose(clip.update(grads, state)[0]["kernel"], 3.0 / 6.0)


def test_the_state_does_not_depend_on_clip_norm():
    """A run stopped with one --clip_norm resumes with another: the state has one structure for all."""
    params = {"w": {"kernel": jnp.ones((4, 3), jnp.float32)}}
    structures = {jax.tree.structure(make_optimizer(OptimizerConfig(clip_norm=c)).init(params)) for c in (0.0, 1.0)}
    assert len(structures) == 1, structures
