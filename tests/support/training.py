"""Small training jobs shared by the tests: the test model, batches that make positions and segments
matter, a mesh of the first devices, and runs of a few steps to compare across meshes and strategies
(fp32; compiles are the expensive part on 2 cores, so each configuration compiles once)."""

import jax
import numpy as np

from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.configs import resolve_model
from meshlm.models.placement import place
from meshlm.strategy import choose
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer
from meshlm.train.state import create_train_state
from meshlm.train.step import compile_step, make_train_step, put_batch, sequence_permutation

B, T, STEPS = 8, 32, 3
LR = 1e-2
CFG = resolve_model("test", {"n_kv_heads": "8"}).replace(dtype="float32")
OPT = OptimizerConfig(lr=LR, warmup_steps=1, total_steps=10)


def make_batches(cfg=CFG, steps=STEPS, batch=B, seq=T, seed=0):
    """Random tokens from a 16-token sub-vocabulary (so the loss can fall), two documents per row (so
    positions and segment ids matter)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        toks = rng.integers(0, 16, (batch, seq + 1), dtype=np.int32)
        cut = seq // 3
        positions = np.concatenate([np.arange(cut), np.arange(seq - cut)]).astype(np.int32)
        segments = np.concatenate([np.ones(cut), 2 * np.ones(seq - cut)]).astype(np.int32)
        mask = np.ones((batch, seq), np.float32)
        mask[:, cut - 1] = 0.0  # the prediction across the document boundary
        out.append(dict(
            inputs=toks[:, :-1], targets=toks[:, 1:], positions=np.tile(positions, (batch, 1)),
            segment_ids=np.tile(segments, (batch, 1)), loss_mask=mask,
        ))
    return out


def mesh_for(dims: str):
    shape = parse_mesh_dim(dims, 1 if dims == "1,1,1,1" else 8)
    return build_mesh(shape, jax.devices()[: shape.n_devices])


def run(dims: str, cfg=CFG, opt_cfg=OPT, grad_accum=1, batches=None):
    placement = place(cfg, mesh_for(dims))
    optimizer = make_optimizer(opt_cfg)
    state = create_train_state(placement, optimizer, seed=0)
    step = make_train_step(placement, optimizer, lr_schedule(opt_cfg), grad_accum)
    perm = sequence_permutation(placement, T)
    losses = []
    for batch in batches or make_batches(cfg):
        state, metrics = step(state, put_batch(placement, batch, perm))
        losses.append(float(metrics["loss"]))
    return dict(placement=placement, state=state, losses=losses, step=step)


def train(placement, with_grads=False, grad_accum=1):
    """Losses of 3 steps, the compiled step (and gradient function), the abstract batch, the final state."""
    optimizer = make_optimizer(OPT)
    step, grads, batch = compile_step(placement, optimizer, B, T, grad_accum, lr_schedule(OPT), with_grads)
    state = create_train_state(placement, optimizer, seed=0)
    perm = sequence_permutation(placement, T)
    losses = []
    for b in make_batches():
        state, metrics = step(state, put_batch(placement, b, perm))
        losses.append(float(metrics["loss"]))
    return dict(losses=losses, step=step, grads=grads, batch=batch, placement=placement, state=state)


def run_strategy(dims: str, strategy: str = "default", zero_stage=None, rules_file=None, with_grads=False, grad_accum=1):
    s, rules = choose(strategy, zero_stage, rules_file)
    return train(place(CFG, mesh_for(dims), s, rules), with_grads, grad_accum)
