"""Training is the same computation on every mesh: losses, parameters, shardings and memory.

One module-scoped run per mesh (3 steps each) is shared by the assertions below: compiles are the
expensive part on 2 cores.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.models.placement import place
from meshlm.optimizer import make_optimizer
from meshlm.train.state import abstract_state
from meshlm.train.step import BATCH_KEYS, put_batch
from tests.support.training import CFG, LR, OPT, POLICY, STEPS, make_batches, mesh_for, run

MESHES = ["1,1,1,1", "8,1,1,1", "1,8,1,1", "1,1,8,1", "2,2,2,1", "1,2,4,1"]


@pytest.fixture(scope="module")
def runs():
    return {dims: run(dims) for dims in MESHES}


@pytest.mark.parametrize("dims", MESHES[1:])
def test_same_losses_on_every_mesh(runs, dims):
    np.testing.assert_allclose(runs[dims]["losses"], runs["1,1,1,1"]["losses"], rtol=1e-5)


@pytest.mark.parametrize("dims", MESHES[1:])
def test_same_gradient_norms_on_every_mesh(runs, dims):
    """The step's norm (`sharding.global_norm`: each device's shards, one reduction) is the one device's."""
    np.testing.assert_allclose(runs[dims]["grad_norms"], runs["1,1,1,1"]["grad_norms"], rtol=1e-5)


@pytest.mark.parametrize("dims", MESHES[1:])
def test_same_parameters_on_every_mesh(runs, dims):
    """fp32 sums in another order differ in the last bits; Adam divides by sqrt(v), so where a gradient is
    ~0 that noise can move one coordinate by a visible fraction of lr. 99% of coordinates must agree to
    0.1% of one update (lr), and none may be off by more than 5% of one update."""
    got, want = jax.device_get(runs[dims]["state"].params), jax.device_get(runs["1,1,1,1"]["state"].params)
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))])
    assert np.quantile(diffs, 0.99) < 1e-3 * LR, np.quantile(diffs, 0.99)
    assert diffs.max() < 0.05 * LR, diffs.max()


def test_training_reduces_loss(runs):
    losses = runs["1,1,1,1"]["losses"]
    assert losses[0] > losses[1] > losses[2]  # it learns the 16-token unigram distribution
    assert int(runs["1,1,1,1"]["state"].step) == STEPS


# Every parameter's sharding, written out by hand from the default table:
# embed -> (fsdp, sp); heads, kv_heads, mlp, vocab -> tp; layers, head_dim -> replicated.
EXPECTED = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm/scale": ("embed",),
    "layers/attn/wq": ("layers", "embed", "heads", None),
    "layers/attn/wk": ("layers", "embed", "heads", None),
    "layers/attn/wv": ("layers", "embed", "heads", None),
    "layers/attn/wo": ("layers", "heads", None, "embed"),
    "layers/attn_norm/scale": ("layers", "embed"),
    "layers/mlp_norm/scale": ("layers", "embed"),
    "layers/mlp/gate": ("layers", "embed", "mlp"),
    "layers/mlp/up": ("layers", "embed", "mlp"),
    "layers/mlp/down": ("layers", "mlp", "embed"),
}


def expected_spec(logical, sizes):
    dp, fsdp, tp, sp = sizes
    embed = tuple(a for a, n in (("fsdp", fsdp), ("sp", sp)) if n > 1)
    table = {"embed": embed[0] if len(embed) == 1 else (embed or None), "layers": None, None: None}
    for name in ("heads", "mlp", "vocab"):
        table[name] = "tp" if tp > 1 else None
    return P(*(table[name] for name in logical))


def flat_params(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flat_params(value, path + "/")
        else:
            yield path, value


@pytest.mark.parametrize("dims", MESHES)
def test_every_parameter_sharding_matches_the_table(runs, dims):
    sizes = tuple(int(x) for x in dims.split(","))
    params = dict(flat_params(runs[dims]["state"].params))
    assert set(params) == set(EXPECTED)
    for path, array in params.items():
        want = expected_spec(EXPECTED[path], sizes)
        assert array.sharding.spec == want, f"{path}: {array.sharding.spec} != {want} on {dims}"
        # Adam moments follow their parameter (so fsdp shards optimizer state too).
    mu = dict(flat_params(runs[dims]["state"].opt_state[1][0].mu))
    for path, array in mu.items():
        assert array.sharding.spec == params[path].sharding.spec, path


def test_optimizer_skips_weight_decay_on_norms():
    from meshlm.optimizer import decay_mask

    mask = dict(flat_params(decay_mask(place(CFG, mesh_for("1,1,1,1"), policy=POLICY).shapes)))
    assert not mask["final_norm/scale"] and not mask["layers/attn_norm/scale"]
    assert mask["layers/mlp/gate"] and mask["embed"]


def _argument_bytes(runs, dims):
    """Per-device bytes of the step's inputs: parameters + optimizer state (+ the tiny batch)."""
    r = runs[dims]
    placement = r["placement"]
    optimizer = make_optimizer(OPT)
    state = abstract_state(placement, optimizer)
    batch = put_batch(placement, make_batches()[0])
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
    compiled = r["step"].lower(state, abstract_batch).compile()
    return compiled.memory_analysis().argument_size_in_bytes, placement


def test_fsdp_divides_parameter_and_optimizer_memory(runs):
    full, _ = _argument_bytes(runs, "1,1,1,1")
    sharded, placement = _argument_bytes(runs, "1,8,1,1")
    assert sharded <= full / 8 * 1.05, (sharded, full)
    # and the parameters alone really are split 8 ways
    assert (
        placement.param_bytes_per_device() * 8
        == place(CFG, mesh_for("1,1,1,1"), policy=POLICY).param_bytes_per_device()
    )


def test_gradient_accumulation_is_exact(runs):
    accumulated = run("2,2,2,1", grad_accum=2)
    np.testing.assert_allclose(accumulated["losses"], runs["1,1,1,1"]["losses"], rtol=1e-5)


def test_batch_keys_are_all_sharded_over_batch(runs):
    placement = runs["2,2,2,1"]["placement"]
    batch = put_batch(placement, make_batches()[0])
    assert set(batch) == set(BATCH_KEYS)
    for array in batch.values():
        assert array.sharding.spec[0] == ("dp", "fsdp")
