"""A batch whose loss_mask counts no token (chat rows holding only prompt tokens): the step's loss is 0,
its gradients zero and its token count 0, the NaN/Inf stop does not fire, and from a fresh optimizer
state the only change to the weights is AdamW's weight decay (none with --weight_decay=0)."""

import dataclasses

import jax
import numpy as np
import pytest

from meshlm.models.placement import place
from meshlm.optimizer import decay_mask, lr_schedule, make_optimizer
from meshlm.strategy import choose
from meshlm.train.diagnostics import NonFiniteWatch
from meshlm.train.state import create_train_state
from meshlm.train.step import make_train_step, put_batch, sequence_permutation
from tests.support.training import CFG, OPT, POLICY, T, make_batches, mesh_for


@pytest.mark.parametrize(
    "dims, zero_stage, grad_accum, weight_decay",
    [
        ("1,1,1,1", None, 1, 0.1),  # XLA's collectives; the default weight decay shrinks the matrices
        ("2,2,2,1", 1, 2, 0.0),  # each data shard's sums in a shard_map, two micro-batches; nothing moves
    ],
)
def test_step_on_a_batch_without_counted_tokens(dims, zero_stage, grad_accum, weight_decay):
    opt = dataclasses.replace(OPT, weight_decay=weight_decay)
    placement = place(CFG, mesh_for(dims), choose("default", zero_stage, None)[0], policy=POLICY)
    optimizer = make_optimizer(opt)
    state = create_train_state(placement, optimizer, seed=0)
    before = jax.device_get(state.params)
    batch = make_batches(steps=1)[0]
    batch["loss_mask"][:] = 0.0
    step = make_train_step(placement, optimizer, lr_schedule(opt), grad_accum)
    state, metrics = step(state, put_batch(placement, batch, sequence_permutation(placement, T)))
    watch = NonFiniteWatch()
    watch.observe(1, metrics)
    assert watch.check(1, state.params) is None

    host = jax.device_get(metrics)
    assert float(host["loss"]) == 0.0 and float(host["grad_norm"]) == 0.0 and float(host["tokens"]) == 0.0
    # Zero gradients and zero moments: Adam's update is 0 / (0 + eps) = 0; decay is lr·wd·W on matrices.
    lr = float(lr_schedule(opt)(0))
    after, decayed = jax.device_get(state.params), decay_mask(before)
    for (path, w0), w1, d in zip(
        jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after), jax.tree.leaves(decayed)
    ):
        if d and weight_decay:
            np.testing.assert_allclose(w1, w0 * (1 - lr * weight_decay), rtol=1e-6, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(w1, w0, err_msg=jax.tree_util.keystr(path))
    moments = [x for x in jax.tree.leaves(jax.device_get(state.opt_state)) if np.ndim(x) > 0]
    assert moments and all(not np.any(m) for m in moments)  # the step leaves no trace in Adam's moments
