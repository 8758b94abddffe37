"""Every preset's structure trains: one step at the presets' compute dtype (bfloat16), on one device and
on a dp x fsdp mesh of the 8 simulated devices.

Each preset is shrunk to tiny widths, one layer and a small vocabulary, keeping what shapes its program:
tied or untied embeddings and its grouped-query ratio (rope scaling comes along, it is a constant). Presets
with the same structure (tied or not, grouped or not) share one case, so each distinct program compiles
once per mesh (6-7 s of CPU each). The tied case is the one XLA:CPU could not run in bfloat16
(`meshlm.models.loss._fence_gradient`); the untied ones are marked slow."""

import jax
import numpy as np
import pytest

from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import PRESETS
from meshlm.optimizer import OptimizerConfig, make_optimizer
from meshlm.train.state import TrainState, abstract_state
from meshlm.train.step import make_train_step, put_batch
from tests.support.training import make_batches, mesh_for

ROWS, SEQ = 8, 16


def shrunk(cfg):
    """`cfg` at test size, its structure kept: tied or not, n_heads / n_kv_heads."""
    return cfg.replace(
        vocab_size=128,
        d_model=32,
        n_layers=1,
        n_kv_heads=2,
        n_heads=2 * cfg.q_per_kv,
        head_dim=8,
        mlp_dim=64,
        max_seq_len=SEQ,
    )


def structures():
    """{(tied, grouped-query): (the first preset with it, its shrunk config)}."""
    found = {}
    for name, cfg in PRESETS.items():
        found.setdefault((cfg.tie_embeddings, cfg.q_per_kv > 1), (name, shrunk(cfg)))
    return found


STRUCTURES = structures()


def host_state(abstract, seed=0):
    """A state of the abstract state's shapes, made on the host (no initialiser to compile): small random
    weights, norm scales 1, zero optimizer moments, step 0."""
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: (
            np.ones
            if "scale" in jax.tree_util.keystr(path)
            else lambda shape, dtype: (rng.normal(size=shape) * 0.02).astype(dtype)
        )(s.shape, s.dtype),
        abstract.params,
    )
    opt_state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract.opt_state)
    state = TrainState(np.zeros((), np.int32), params, opt_state)
    return jax.device_put(state, jax.tree.map(lambda s: s.sharding, abstract))


def test_the_presets_cover_tied_and_grouped_structures():
    assert set(STRUCTURES) == {(False, False), (False, True), (True, True)}
    assert STRUCTURES[True, True][0] == "llama3.2-1b" and STRUCTURES[True, True][1].q_per_kv == 4


def case(structure):
    tied, grouped = structure
    marks = () if tied else (pytest.mark.slow,)
    name, cfg = STRUCTURES[structure]
    return pytest.param(structure, marks=marks, id=f"{name}-{'tied' if tied else 'untied'}-q_per_kv{cfg.q_per_kv}")


@pytest.mark.parametrize("dims", ["1,1,1,1", "2,4,1,1"])
@pytest.mark.parametrize("structure", [case(s) for s in sorted(STRUCTURES)])
def test_one_train_step_in_the_presets_dtype(structure, dims):
    name, cfg = STRUCTURES[structure]
    assert RunPolicy().dtype == "bfloat16"  # a run computes in bfloat16 unless --dtype says otherwise
    placement = place(cfg, mesh_for(dims))
    optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=1, total_steps=2))
    state = host_state(abstract_state(placement, optimizer))
    step = make_train_step(placement, optimizer)
    batch = make_batches(cfg, steps=1, batch=ROWS, seq=SEQ)[0]
    state, metrics = step(state, put_batch(placement, batch))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"])), name
    assert int(state.step) == 1
