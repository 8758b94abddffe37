"""Shared by the strategy tests: the tiny model, its batches, and one reference run on one device.

Every other run is compared with the reference's losses (fp32, rtol 1e-5). Compiles are the expensive
part on 2 cores: each configuration is compiled once (ahead of time) and that one executable both runs
the steps and is read for its memory and HLO."""

import pytest

from meshlm.models.placement import place
from meshlm.strategy import choose
from meshlm.train.optimizer import lr_schedule, make_optimizer
from meshlm.train.state import create_train_state
from meshlm.train.step import compile_step, put_batch, sequence_permutation
from tests.train.test_train_step import B, CFG, OPT, T, make_batches, mesh_for


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


def run(dims: str, strategy: str = "default", zero_stage=None, rules_file=None, with_grads=False, grad_accum=1):
    s, rules = choose(strategy, zero_stage, rules_file)
    return train(place(CFG, mesh_for(dims), s, rules), with_grads, grad_accum)


@pytest.fixture(scope="session")
def reference():
    return run("1,1,1,1")["losses"]


__all__ = ["run", "train", "B", "T", "CFG"]
