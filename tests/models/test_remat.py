"""Remat policies: the loss and gradients of keeping everything, the memory they claim, and no second
attention forward in the backward pass for the policies that save the attention's output.

Two small jobs, each compiled once per policy and shared by the tests: one device at 1024 tokens
(the blockwise kernel, a custom VJP with a log-sum-exp), and RingAttention over sp=2 with tp=2 (the
ring's custom VJP inside a shard_map, and a tensor-parallel output projection), float32.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import hlo
from meshlm.config import REMAT
from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.decoder import REMAT_POLICIES
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.plan import memory
from meshlm.plan.job import Job

CFG = resolve_model("test", {"n_kv_heads": "2", "n_layers": "2"})
F32 = RunPolicy(dtype="float32")
# (mesh_dim, batch, seq_len): blockwise attention from 1024 tokens on; a ring when sp > 1
JOBS = {"blockwise": ("1,1,1,1", 1, 1024), "ring": ("1,1,2,2", 2, 64)}
SAVING = ("save_attn", "save_qkv_attn")  # the policies that keep the attention's output and log-sum-exp


def _loss(placement, params, tokens, targets):
    logits = placement.apply(params, tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


@functools.cache
def _inputs(job: str):
    mesh_dim, batch, seq = JOBS[job]
    shape = parse_mesh_dim(mesh_dim, math.prod(int(n) for n in mesh_dim.split(",")))
    mesh = build_mesh(shape, jax.devices()[: shape.n_devices])
    rng = np.random.default_rng(0)
    tokens, targets = (jnp.asarray(rng.integers(0, CFG.vocab_size, (batch, seq)), jnp.int32) for _ in range(2))
    return mesh, place(CFG, mesh, policy=F32).init(seed=0), tokens, targets


@functools.cache
def compiled(job: str, policy: str):
    """(the compiled loss-and-gradient program, its loss and gradients) of `job` under `policy`."""
    mesh, params, tokens, targets = _inputs(job)
    placement = place(CFG, mesh, policy=F32.replace(remat=policy))
    step = jax.jit(jax.value_and_grad(functools.partial(_loss, placement))).lower(params, tokens, targets).compile()
    loss, grads = step(params, tokens, targets)
    return step, float(loss), grads


def temp_bytes(job, policy) -> int:
    return compiled(job, policy)[0].memory_analysis().temp_size_in_bytes


def while_loops(job, policy) -> int:
    return compiled(job, policy)[0].as_text().count(" while(")


def collective_bytes(job, policy) -> dict[str, int]:
    return hlo.summarize(hlo.parse_collectives(compiled(job, policy)[0].as_text()))


@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize("policy", [*SAVING, "full"])
def test_policies_give_the_loss_and_gradients_of_none(job, policy):
    """(save_dots, which names nothing, is checked on dense attention with the others in test_decoder.py.)"""
    _, loss0, grads0 = compiled(job, "none")
    _, loss1, grads1 = compiled(job, policy)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), grads1, grads0)


def test_saving_policies_do_not_run_the_attention_forward_again_in_the_backward():
    """The blockwise kernel's forward is two nested loops: `full` runs it twice, once more in the
    backward pass; a policy that saves the output and the log-sum-exp runs it once, as `none` does.
    (Without the names on the custom VJP's residuals, save_qkv_attn counted as many loops as full.)"""
    loops = {p: while_loops("blockwise", p) for p in ("none", "full", *SAVING)}
    assert loops["save_attn"] == loops["save_qkv_attn"] == loops["none"] < loops["full"], loops


def test_saving_policies_do_not_send_the_ring_around_again():
    """RingAttention's forward passes k and v around the ring; under `full` the backward repeats it."""
    sent = {p: collective_bytes("ring", p)["collective-permute"] for p in ("none", "full", *SAVING)}
    assert sent["save_attn"] == sent["save_qkv_attn"] == sent["none"] < sent["full"], sent


def test_save_attn_does_not_repeat_the_output_projection_all_reduce():
    """tp: the output projection sums partial outputs over tp; save_attn keeps the sum, save_qkv_attn
    recomputes it (and so all-reduces it again in the backward pass)."""
    summed = {p: collective_bytes("ring", p)["all-reduce"] for p in ("none", *SAVING)}
    assert summed["save_attn"] == summed["none"] < summed["save_qkv_attn"], summed


def test_compiled_memory_falls_as_policies_save_less():
    temp = {p: temp_bytes("blockwise", p) for p in ("none", "save_attn", "save_qkv_attn", "full")}
    assert temp["none"] > temp["save_attn"] > temp["save_qkv_attn"] > temp["full"], temp


@pytest.mark.parametrize("policy", ["none", *SAVING])
def test_planner_activations_match_what_the_compiled_program_saves(policy):
    """The planner's activation bytes above `full` equal the compiled temp bytes above `full` (10%):
    what each policy keeps per token and layer, the attention's float32 log-sum-exp included."""
    mesh_dim, batch, seq = JOBS["blockwise"]
    shape = parse_mesh_dim(mesh_dim, 1)

    def planned(remat):
        return memory.estimate(Job(CFG, batch, seq, 1, 1, policy=F32.replace(remat=remat)), shape).activations

    predicted = planned(policy) - planned("full")
    got = temp_bytes("blockwise", policy) - temp_bytes("blockwise", "full")
    assert abs(predicted - got) <= 0.1 * got, (policy, predicted, got)


def test_every_policy_is_a_flag_value():
    assert set(REMAT_POLICIES) <= set(REMAT)


def test_planner_orders_the_policies_by_what_they_keep():
    """llama3-8b at 8192 tokens, bf16, tp=8 (blockwise attention: the log-sum-exp counts)."""
    cfg = resolve_model("llama3-8b", {})
    loc = Job(cfg, 8, 8192, 8, 1, policy=RunPolicy(dtype="bfloat16")).local(parse_mesh_dim("1,1,8,1", 8))
    kept = [memory.saved_per_token_layer(loc, p) for p in ("full", "save_qkv_attn", "save_attn", "save_dots", "none")]
    assert kept == sorted(set(kept)), kept
