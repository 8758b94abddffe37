"""One jitted, donated train step: loss, gradients (with optional accumulation), AdamW update.

The loss is the mean token cross-entropy (float32) over tokens whose `loss_mask` is 1. With gradient
accumulation the step sums losses and token counts over micro-batches and divides once, so the update
is exactly the one of a single large batch. The division is by max(count, 1): a batch that counts no
token (chat rows holding only prompt tokens) has loss 0 and zero gradients, not 0/0 = NaN, and the
step reports `tokens` 0.

Three gradient paths share one micro-batcher (`sharding.micro_batches`): the pipeline's stages
(`--pp`); ZeRO 0-2, each data shard in a `shard_map` with one all-reduce or reduce-scatter a gradient;
otherwise XLA's partitioner places the collectives. The job refuses options they cannot combine.

Which parameters train is a `meshlm.train.trainable.Trainable` (`trainable=`; None: every weight): the
gradients, the clipping and the AdamW update are its trained tree's alone, and a frozen tree (LoRA's
base) passes through the step untouched (donated, so not copied).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshlm import backends, sharding
from meshlm.errors import UsageError
from meshlm.models.pipelined import pipelined_loss_and_grads
from meshlm.models.placement import Placement
from meshlm.ops.pipeline import Schedule
from meshlm.train.state import TrainState, state_shardings
from meshlm.train.trainable import Trainable, model_loss_sums, trained_by

loss_sums = model_loss_sums  # the training loss of every path: evaluation and the tests take it from here
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def _grad_fn(placement: Placement, trainable: Trainable) -> Callable:
    """`f(trained, batch, frozen) -> ((loss sum, count), gradients of the trained tree)`."""
    return jax.value_and_grad(lambda t, b, f: trainable.loss_sums(placement, t, b, f), has_aux=True)


def _loss_grad_sums(grad_fn: Callable, params: Any, batch: dict, frozen: Any, grad_accum: int, layout: tuple = ()):
    """(sum of token losses, token count, summed gradients) of `batch`; over `grad_accum` micro-batches
    (`sharding.micro_batches`, one scan) when more than one. `layout`: (mesh, strategy) to keep the
    micro-batches' rows laid out as the batch's (none inside a shard_map)."""
    if grad_accum == 1:
        (nll, count), grads = grad_fn(params, batch, frozen)
        return nll, count, grads
    micro = sharding.micro_batches(batch, grad_accum, *layout)

    def accumulate(carry, one):
        (nll, count), grads = grad_fn(params, one, frozen)
        return jax.tree.map(jnp.add, carry, (nll, count, grads)), None

    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(accumulate, zeros, micro)[0]


def _combine(g: jax.Array, spec: jax.sharding.PartitionSpec, data: tuple[str, ...]) -> jax.Array:
    """One data shard's gradient -> the sum over all data shards, in the layout `spec` asks for over the
    data axes: all-reduce over the axes the spec does not use, reduce-scatter onto those it does."""
    scattered = [(d, sharding.as_tuple(sharding.filter_axes(e, only=data))) for d, e in enumerate(spec)]
    scattered = [(d, axes) for d, axes in scattered if axes]
    rest = tuple(a for a in data if all(a not in axes for _, axes in scattered))
    if rest:
        g = jax.lax.psum(g, rest)
    for d, axes in scattered:
        g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=d, tiled=True)
    return g


def data_parallel_loss_grads(placement: Placement, grad_accum: int = 1, trainable: Trainable | None = None) -> Callable:
    """ZeRO stages 0–2: `f(params, batch, frozen) -> (loss sum, token count, summed gradients)`, each data
    shard working on its own rows with the whole (replicated) weights, one collective per gradient."""
    mesh = placement.mesh
    data = placement.strategy.data_axes(mesh)
    local = dataclasses.replace(
        placement,
        strategy=sharding.without_axes(placement.strategy, data),
        groups=tuple(
            dataclasses.replace(g, strategy=sharding.without_axes(g.strategy, data)) for g in placement.groups
        ),
    )
    local.structure  # noqa: B018  built (abstractly) here: no parameter can be declared inside the shard_map
    trainable = trained_by(placement, trainable)
    grad_fn = _grad_fn(local, trainable)
    grad_specs, frozen_specs = trainable.grad_specs, trainable.frozen_specs
    P = jax.sharding.PartitionSpec

    def body(params, batch, frozen):
        nll, count, grads = _loss_grad_sums(grad_fn, params, batch, frozen, grad_accum)
        nll, count = jax.lax.psum((nll, count), data)
        grads = jax.tree.map(
            lambda g, spec: _combine(g, spec, data), grads, grad_specs, is_leaf=lambda x: isinstance(x, P)
        )
        return nll, count, grads

    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    whole = lambda specs: jax.tree.map(lambda _: P(), specs, is_leaf=is_spec)  # noqa: E731
    return jax.shard_map(
        body,
        mesh=mesh,
        axis_names=set(data),
        check_vma=False,
        in_specs=(whole(grad_specs), P(data), None if frozen_specs is None else whole(frozen_specs)),
        out_specs=(P(), P(), jax.tree.map(lambda s: sharding.filter_spec(s, only=data), grad_specs, is_leaf=is_spec)),
    )


def make_train_step(
    placement: Placement,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
    grad_accum: int = 1,
    pipeline: Schedule | None = None,
    trainable: Trainable | None = None,
    compiler_options: dict | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """`step(state, batch) -> (state, metrics)`; the state's buffers are donated (updated in place).

    With `pipeline`, the mesh has a pp axis and the layers run as pipeline stages over microbatches
    (`meshlm.models.pipelined`); the update is the same. `trainable`: which parameters train. The
    program compiles with its backend profile's options (`program_options`), and `compiler_options`
    on top of them. With the sequence split over a ring, batches must come from `put_batch` with
    `sequence_permutation` (zigzag order): the fused RingAttention kernels mask by that order."""
    trainable = trained_by(placement, trainable)
    mean_loss_grads = make_loss_grads(placement, grad_accum, pipeline, trainable)
    update = optax.with_extra_args_support(optimizer).update
    grad_specs = trainable.grad_specs
    profile = backends.profile_for(placement.platform)
    # Where the profile asks for it (XLA:CPU), gradients split over the data axes take their norm in one
    # reduction across devices (docs/kernels.md, "Backend profiles").
    split = profile.one_reduction_grad_norm and sharding.splits_over(
        grad_specs, placement.strategy.data_axes(placement.mesh)
    )

    def norm_of(grads):
        return sharding.global_norm(grads, placement.mesh, grad_specs) if split else optax.tree.norm(grads)

    def step(state: TrainState, batch: dict):
        trained, frozen = trainable.split(state.params)
        with sharding.token_order(ring_order(placement)):  # `put_batch` lays a split sequence out so
            nll, count, grads = mean_loss_grads(trained, batch, frozen)
        grad_norm = norm_of(grads)  # once, for the clip and the metric
        updates, opt_state = update(grads, state.opt_state, trained, grad_norm=grad_norm)
        trained = optax.apply_updates(trained, updates)
        params = trainable.join(trained, frozen)
        metrics = {"loss": nll / jnp.maximum(count, 1.0), "grad_norm": grad_norm, "tokens": count}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    shardings = state_shardings(placement, optimizer, trainable)
    batch_shardings = {k: sharding.batch_sharding(placement.mesh, placement.strategy) for k in BATCH_KEYS}
    profile.keep_host_memory()  # where the profile asks: each step's scratch stays mapped for the next
    return jax.jit(
        step,
        in_shardings=(shardings, batch_shardings),
        out_shardings=(shardings, sharding.replicated(placement.mesh)),
        donate_argnums=0,
        compiler_options=program_options(placement, pipelined=pipeline is not None, extra=compiler_options),
    )


def program_options(placement: Placement, *, pipelined: bool = False, extra: dict | None = None) -> dict | None:
    """The XLA options a train or eval program on `placement`'s mesh compiles with: its backend
    profile's (`meshlm.backends`), then `extra`."""
    options = {
        **(backends.profile_for(placement.platform).compiler_options(pipelined=pipelined) or {}),
        **(extra or {}),
    }
    return options or None


def make_loss_grads(
    placement: Placement, grad_accum: int = 1, pipeline: Schedule | None = None, trainable: Trainable | None = None
) -> Callable:
    """`f(params, batch, frozen=None) -> (sum of token losses, token count, gradients of the mean loss)`,
    the gradients in the placement's gradient layout; the mean is over max(count, 1) tokens (zero
    gradients when no token counts). Traceable (the train step's first half). `params` is the trained
    tree of `trainable` (every weight when None), `frozen` the rest."""
    trainable = trained_by(placement, trainable)
    grad_fn = _grad_fn(placement, trainable)
    stage = placement.strategy.zero_stage  # with --pp, stages 0-2 are refused by the job (`strategy.check_pipelined`)
    explicit = pipeline is None and stage is not None and stage < 3 and placement.strategy.data_axes(placement.mesh)
    if pipeline is not None and not trainable.pipelines:
        raise UsageError("--lora_rank with --pp: LoRA does not run pipelined yet; drop --pp (or pp: in --mesh_dim)")
    local_grads = data_parallel_loss_grads(placement, grad_accum, trainable) if explicit else None
    layout = (placement.mesh, placement.strategy)
    grad_shardings = trainable.grad_shardings

    def mean_loss_grads(params, batch, frozen=None):
        if pipeline is not None:  # gradients already over max(count, 1); its count is clamped: report the true one
            (nll, _), grads = pipelined_loss_and_grads(placement, pipeline, params, batch)
            count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
            return nll, count, jax.lax.with_sharding_constraint(grads, placement.grad_shardings)
        if local_grads is not None:
            nll, count, grads = local_grads(params, batch, frozen)
        else:
            nll, count, grads = _loss_grad_sums(grad_fn, params, batch, frozen, grad_accum, layout)
        tokens = jnp.maximum(count, 1.0)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return nll, count, jax.tree.map(lambda g: g / tokens, grads)

    return mean_loss_grads


def ring_order(placement: Placement) -> str | None:
    """The order of a split sequence's tokens in the batches `put_batch` lays out with
    `sequence_permutation`: "zigzag" when the sequence is split over a ring, else None."""
    return "zigzag" if sharding.sequence_parallel_size(placement.mesh, placement.strategy) > 1 else None


def sequence_permutation(placement: Placement, seq_len: int) -> np.ndarray | None:
    """The load-balancing (zigzag) order of the sequence when it is split over a ring, else None."""
    sp = sharding.sequence_parallel_size(placement.mesh, placement.strategy)
    if sp == 1:
        return None
    from meshlm.ops.ring import zigzag_permutation

    return zigzag_permutation(seq_len, sp)


def put_batch(placement: Placement, local_batch: dict, perm: np.ndarray | None = None) -> dict:
    """This process's rows (numpy) -> global arrays laid out on the mesh, in ring order when `perm` is set."""
    target = sharding.batch_sharding(placement.mesh, placement.strategy)
    out = {}
    for key in BATCH_KEYS:
        x = np.asarray(local_batch[key])
        if perm is not None:
            x = x[:, perm]
        out[key] = jax.make_array_from_process_local_data(target, x)
    return out


def abstract_batch(placement: Placement, batch_size: int, seq_len: int) -> dict:
    """ShapeDtypeStructs of one global batch, laid out on the mesh: for ahead-of-time compiles."""
    rows = sharding.batch_sharding(placement.mesh, placement.strategy)
    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=rows)
        for k in BATCH_KEYS
    }


def compile_step(
    placement: Placement,
    optimizer: optax.GradientTransformation,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    with_grads: bool = True,
    trainable: Trainable | None = None,
):
    """(compiled train step, compiled gradient function or None, abstract batch), nothing allocated. The
    compiled step can be called like the jitted one; the gradient function's outputs are the step's gradients."""
    from meshlm.train.state import abstract_state

    trainable = trained_by(placement, trainable)
    state, batch = abstract_state(placement, optimizer, trainable), abstract_batch(placement, batch_size, seq_len)
    step = (
        make_train_step(placement, optimizer, schedule, grad_accum, trainable=trainable).lower(state, batch).compile()
    )
    if not with_grads:
        return step, None, batch
    loss_grads = make_loss_grads(placement, grad_accum, trainable=trainable)

    def grads_of(params, batch):
        trained, frozen = trainable.split(params)
        return loss_grads(trained, batch, frozen)[2]

    grads = jax.jit(grads_of, out_shardings=trainable.grad_shardings)
    return step, grads.lower(state.params, batch).compile(), batch
