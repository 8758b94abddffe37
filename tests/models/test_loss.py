"""The chunked loss: the value and gradients of the whole-batch loss (alone, in the model, tied and
untied, on meshes that split rows, sequence and vocabulary), much less temporary memory for a large
vocabulary, compute-dtype matmuls in the backward pass, and the embedding gathered in the compute dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from meshlm.errors import UsageError
from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.loss import head_loss_sums, num_chunks, project, token_loss_sums
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.ops.pipeline import build_schedule
from meshlm.optimizer import OptimizerConfig, make_optimizer
from meshlm.strategy import choose
from meshlm.train.state import abstract_state
from meshlm.train.step import BATCH_KEYS, loss_sums, make_loss_grads, make_train_step, put_batch, sequence_permutation
from tests.support.training import make_batches, mesh_for

B, T, E, V = 3, 24, 16, 50

F32 = RunPolicy(dtype="float32")


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, V)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) > 0.3, jnp.float32)  # about a third of the tokens not counted
    whole = jax.jit(jax.value_and_grad(lambda x, w: token_loss_sums(project(x, w), targets, mask)[0], argnums=(0, 1)))
    return x, w, targets, mask, whole(x, w)


@pytest.mark.parametrize("chunk, n", [(4, 6), (5, 5), (7, 4), (24, 1), (100, 1), (0, 1)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_chunked_loss_and_gradients_equal_the_whole(operands, chunk, n, one_hot):
    """Chunks that divide T, that do not (5: padded to 25), larger than T, and none."""
    x, w, targets, mask, (want, (want_dx, want_dw)) = operands
    assert num_chunks(T, chunk) == n
    f = jax.jit(
        jax.value_and_grad(
            lambda x, w: head_loss_sums(x, w, targets, mask, chunk=chunk, one_hot=one_hot)[0], argnums=(0, 1)
        )
    )
    got, (dx, dw) = f(x, w)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-7)
    assert float(head_loss_sums(x, w, targets, mask, chunk=chunk)[1]) == float(jnp.sum(mask))


def _batch(cfg, seq=T, rows=4, seed=1):
    rng = np.random.default_rng(seed)
    mask = (rng.random((rows, seq)) > 0.25).astype(np.float32)
    return {
        "inputs": rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32),
        "targets": rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
        "segment_ids": np.ones((rows, seq), np.int32),
        "loss_mask": mask,
    }


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_and_gradients_do_not_depend_on_the_chunk(tied):
    cfg = resolve_model("test", {"n_layers": "1", "tie_embeddings": str(tied)})
    batch = _batch(cfg)
    mesh = mesh_for("1,1,1,1")
    params = place(cfg, mesh, policy=F32).init(0)  # the same weights for both: loss_chunk changes no parameter
    results = []
    for chunk in (0, 5):
        placement = place(cfg, mesh, policy=F32.replace(loss_chunk=chunk))
        results.append(
            jax.jit(jax.value_and_grad(lambda p, placement=placement: loss_sums(placement, p, batch), has_aux=True))(
                params
            )
        )
    ((want, count), want_grads), ((got, got_count), grads) = results
    assert float(got_count) == float(count) == batch["loss_mask"].sum()
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


MESH_CASES = [  # (mesh_dim, strategy, zero_stage, pipeline): rows, sequence (zigzag) and vocabulary split
    ("2,2,2,1", "default", None, None),
    ("1,2,1,4", "default", None, None),  # RingAttention: the sequence over sp in zigzag order
    ("1,2,2,2", "megatron_sp", None, None),  # length over tp between the tensor-parallel regions
    ("2,2,2,1", "default", 1, None),  # each data shard its own loss in a shard_map
    ("1,1,2,1", "default", None, ("1f1b", 2, 4)),  # pp=2 in front: the head inside the last stage
]


@pytest.fixture(scope="module")
def unchunked_reference():
    batch = make_batches(steps=1)[0]
    cfg = resolve_model("test", {"n_kv_heads": "8"})
    placement = place(cfg, mesh_for("1,1,1,1"), policy=F32.replace(loss_chunk=0))
    params = placement.init(0)
    nll, count, grads = jax.jit(make_loss_grads(placement))(params, put_batch(placement, batch))
    return batch, cfg, params, float(nll / count), grads


@pytest.mark.parametrize("dims, strategy, zero_stage, pipe", MESH_CASES)
def test_chunked_loss_on_meshes_equals_one_device_unchunked(unchunked_reference, dims, strategy, zero_stage, pipe):
    batch, cfg, params, want, want_grads = unchunked_reference
    chunked = F32.replace(loss_chunk=5)  # T = 32: 7 chunks of 5 positions, 3 of them padding
    schedule = None
    if pipe is None:
        mesh = mesh_for(dims)
    else:
        name, pp, microbatches = pipe
        shape = parse_mesh_dim(dims, pp * int(np.prod([int(d) for d in dims.split(",")])), pp=pp)
        mesh, schedule = build_mesh(shape, jax.devices()[: shape.n_devices]), build_schedule(name, pp, microbatches)
    placement = place(cfg, mesh, choose(strategy, zero_stage, None)[0], policy=chunked)
    perm = sequence_permutation(placement, batch["inputs"].shape[1])
    params = jax.device_put(params, placement.shardings)  # the reference's weights, laid out on this mesh
    nll, count, grads = jax.jit(make_loss_grads(placement, pipeline=schedule))(
        params, put_batch(placement, batch, perm)
    )
    np.testing.assert_allclose(float(nll / count), want, rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


def _step_temp_bytes(loss_chunk: int, rows: int = 8, seq: int = 256) -> int:
    cfg = resolve_model("test", {"vocab_size": "32768"})
    placement = place(cfg, mesh_for("1,1,1,1"), policy=F32.replace(loss_chunk=loss_chunk))
    optimizer = make_optimizer(OptimizerConfig())
    batch = {k: jax.ShapeDtypeStruct((rows, seq), np.float32 if k == "loss_mask" else np.int32) for k in BATCH_KEYS}
    step = make_train_step(placement, optimizer).lower(abstract_state(placement, optimizer), batch).compile()
    return step.memory_analysis().temp_size_in_bytes


def test_chunked_loss_needs_far_less_temporary_memory_for_a_large_vocabulary():
    """Vocabulary 32768, 8 rows of 256 tokens, one device: float32 logits of 256 MiB, held in chunks of 32."""
    whole, chunked = _step_temp_bytes(0), _step_temp_bytes(32)
    assert chunked < 0.4 * whole, (chunked, whole)


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs nested in it (scan, checkpoint, jit) too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_backward_matmuls_run_in_the_compute_dtype(operands):
    x, w, targets, mask, _ = operands
    f = jax.grad(lambda x, w: head_loss_sums(x, w, targets, mask, chunk=5)[0], argnums=(0, 1))
    dots = [
        tuple(v.aval.dtype for v in e.invars)
        for e in _eqns(jax.make_jaxpr(f)(x.astype(jnp.bfloat16), w).jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert len(dots) >= 3 and all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots  # logits, dx, dw


def test_bfloat16_loss_and_gradients_follow_float32(operands):
    """The compute-dtype backward (its own rule) against float32 autodiff on the same rounded operands."""
    x, w, targets, mask, _ = operands
    x16 = x.astype(jnp.bfloat16)
    f = jax.jit(jax.value_and_grad(lambda x, w: head_loss_sums(x, w, targets, mask, chunk=5)[0], argnums=(0, 1)))
    w_rounded = w.astype(jnp.bfloat16).astype(jnp.float32)  # the matmul's operand
    (got, (dx, dw)), (want, (want_dx, want_dw)) = f(x16, w), f(x16.astype(jnp.float32), w_rounded)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)  # float32 logits: only the sum order differs
    np.testing.assert_allclose(dx.astype(jnp.float32), want_dx, rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(dw, want_dw, rtol=2e-2, atol=2e-3)


def test_embedding_rows_are_gathered_in_the_compute_dtype():
    cfg = resolve_model("test", {"n_layers": "1"})
    model = place(cfg, mesh_for("1,1,1,1"), policy=RunPolicy(dtype="bfloat16")).structure
    table = jnp.asarray(np.random.default_rng(0).normal(size=(cfg.vocab_size, cfg.d_model)), jnp.float32)
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t: model.embed_tokens(tokens, None, {"embed": t})[0])(table)
    gathers = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "gather"]
    assert gathers and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in gathers)
    x = model.embed_tokens(tokens, None, {"embed": table})[0]
    np.testing.assert_array_equal(x, table.astype(jnp.bfloat16)[tokens])


def test_negative_loss_chunk_is_refused():
    with pytest.raises(UsageError, match="loss_chunk=-1"):
        RunPolicy(loss_chunk=-1)
