"""Small training jobs shared by the tests: the test model, batches that make positions and segments
matter, a mesh of the first devices, and runs of a few steps to compare across meshes and strategies
(fp32; compiles are the expensive part on 2 cores, so each configuration compiles once)."""

import jax
import numpy as np

from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer
from meshlm.strategy import choose
from meshlm.train.state import create_train_state, state_shardings
from meshlm.train.step import compile_step, make_train_step, put_batch, sequence_permutation

B, T, STEPS = 8, 32, 3
LR = 1e-2
CFG = resolve_model("test", {"n_kv_heads": "8"})
POLICY = RunPolicy(dtype="float32")
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
        out.append(
            dict(
                inputs=toks[:, :-1],
                targets=toks[:, 1:],
                positions=np.tile(positions, (batch, 1)),
                segment_ids=np.tile(segments, (batch, 1)),
                loss_mask=mask,
            )
        )
    return out


def mesh_for(dims: str):
    shape = parse_mesh_dim(dims, 1 if dims == "1,1,1,1" else 8)
    return build_mesh(shape, jax.devices()[: shape.n_devices])


_made_on = {}  # (cfg, policy, opt_cfg, dims, rules_file) -> the fresh state create_train_state made on that mesh, on the host


def fresh_state(placement, optimizer, key):
    """create_train_state's state (seed 0) on this placement: made on this mesh by its own initialiser the
    first time `key` is asked for, then put back from a host copy (the same values, one compile fewer)."""
    if key not in _made_on:
        state = create_train_state(placement, optimizer, seed=0)
        _made_on[key] = jax.device_get(state)
        return state
    return jax.device_put(_made_on[key], state_shardings(placement, optimizer))


def run(dims: str, cfg=CFG, opt_cfg=OPT, grad_accum=1, batches=None, shared_init=False, rules_file=None, policy=POLICY):
    """Losses of training from create_train_state's state on `dims`; with `shared_init`, from the state
    made on one device, laid out for `dims` (see `train`). `rules_file`: a --sharding_rules file."""
    placement = place(cfg, mesh_for(dims), *choose("default", None, rules_file), policy=policy)
    optimizer = make_optimizer(opt_cfg)
    if shared_init:
        state = jax.device_put(initial_state_on_host(cfg, opt_cfg, policy), state_shardings(placement, optimizer))
    else:
        state = fresh_state(placement, optimizer, (cfg, policy, opt_cfg, dims, rules_file))
    step = make_train_step(placement, optimizer, lr_schedule(opt_cfg), grad_accum)
    batches = batches or make_batches(cfg)
    perm = sequence_permutation(placement, batches[0]["inputs"].shape[1])
    losses, grad_norms = [], []
    for batch in batches:
        state, metrics = step(state, put_batch(placement, batch, perm))
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    return dict(placement=placement, state=state, losses=losses, grad_norms=grad_norms, step=step)


def initial_state_on_host(cfg=CFG, opt_cfg=OPT, policy=POLICY):
    """A fresh train state (seed 0) made on one device, on the host: compiling the initialiser costs about
    as much as compiling a train step on 2 CPU cores, so this is done once per model and optimizer."""
    key = (cfg, policy, opt_cfg, "1,1,1,1", None)
    if key not in _made_on:
        fresh_state(place(cfg, mesh_for("1,1,1,1"), policy=policy), make_optimizer(opt_cfg), key)
    return _made_on[key]


def train(placement, with_grads=False, grad_accum=1, shared_init=False):
    """Losses of 3 steps, the compiled step (and gradient function), the abstract batch, the final state.
    `shared_init`: start from `initial_state_on_host()` laid out as this placement's state is (the same
    values `create_train_state` makes on any mesh, without compiling it for this one)."""
    optimizer = make_optimizer(OPT)
    step, grads, batch = compile_step(placement, optimizer, B, T, grad_accum, lr_schedule(OPT), with_grads)
    if shared_init:
        assert placement.cfg == CFG and placement.policy == POLICY and not placement.groups, (
            "the shared state is CFG's, without layer groups"
        )
        state = jax.device_put(initial_state_on_host(), state_shardings(placement, optimizer))
    else:
        state = create_train_state(placement, optimizer, seed=0)
    perm = sequence_permutation(placement, T)
    losses, grad_norms = [], []
    for b in make_batches():
        state, metrics = step(state, put_batch(placement, b, perm))
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    return dict(
        losses=losses, grad_norms=grad_norms, step=step, grads=grads, batch=batch, placement=placement, state=state
    )


def run_strategy(
    dims: str,
    strategy: str = "default",
    zero_stage=None,
    rules_file=None,
    with_grads=False,
    grad_accum=1,
    shared_init=False,
):
    s, rules = choose(strategy, zero_stage, rules_file)
    return train(place(CFG, mesh_for(dims), s, rules, policy=POLICY), with_grads, grad_accum, shared_init)
