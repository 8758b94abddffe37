"""One attention entry point that runs the kernel each backend needs.

    attention(q, k, v, q_positions=..., kv_positions=..., kernel="auto", platform="tpu", layout=...)

Shapes and masking are those of `meshlm.ops.attention`. Kernels: `dense` (the [T, S] reference),
`blockwise` (flash-style online softmax in pure JAX, any positions), `splash` (TPU, Pallas), `cudnn`
and `triton` (GPU, `meshlm.ops.gpu`). `auto` takes the first of the backend profile's fused kernels
(`meshlm.backends`) that can serve the call, then dense below the profile's `dense_attention_below`
tokens, else blockwise; it never raises. A kernel forced by name that cannot serve the call raises one
`UsageError` line saying why. The fused kernels mask by index (causal self-attention with positions
increasing along each document) and, like blockwise, pad a length their blocks do not divide. XLA does
not partition Pallas and cuDNN calls: under a mesh, `layout` names the mesh and specs and the kernel
runs in a `shard_map` over the batch and head axes. `interpret=True` runs the Pallas kernels in
interpret mode and cudnn as its XLA twin on any backend. docs/kernels.md has the whole story.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshlm.backends import DENSE_ATTENTION_BELOW, profile_for
from meshlm.errors import UsageError
from meshlm.ops import attention as attn
from meshlm.ops.gpu import MAX_DOCUMENTS
from meshlm.ops.kernel_names import KERNELS

# `auto` with no fused kernel: dense attention below this many tokens, blockwise from there (the
# backend's profile chooses; docs/kernels.md says why).
DENSE_BELOW = DENSE_ATTENTION_BELOW
BLOCK = 512  # the blockwise kernel's largest block (queries and keys)
_HOME = {"splash": "tpu", "cudnn": "gpu", "triton": "gpu"}


class Layout(NamedTuple):
    """Where the arrays live: the mesh (or, inside a shard_map, its abstract mesh) and the specs of
    q/out [B,T,H,D], k/v [B,S,KVH,D] and segment ids [B,T]. Their length entries must be None."""

    mesh: object
    q_spec: PartitionSpec
    kv_spec: PartitionSpec
    seq_spec: PartitionSpec


class Call(NamedTuple):
    """What decides whether a kernel can serve an attention call (all static)."""

    platform: str  # "cpu", "gpu" or "tpu"
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    packed: bool  # segment ids given
    causal: bool
    interpret: bool = False
    gpu_capability: float | None = None  # the GPU's compute capability (9.0 for Hopper); None: not known
    window: int = 0  # sliding-window (local) attention over this many positions; 0: global
    softcap: float = 0.0  # attention-logit soft cap; 0: none


# cuDNN's packed-document layout (per-document offsets) runs on Hopper and later GPUs only.
PACKED_CUDNN_CAPABILITY = 9.0


def padded_length(t: int, max_block: int, align: int) -> tuple[int, int]:
    """(padded length, block): the fewest blocks of at most `max_block` tokens, each a multiple of
    `align`, that cover t tokens. E.g. 8000 -> (8192, 512), 1030 -> (1152, 384), 100 -> (128, 128)."""
    n = max(1, math.ceil(t / max_block))
    block = math.ceil(math.ceil(t / n) / align) * align
    return n * block, block


def why_not(kernel: str, call: Call) -> str | None:
    """Why `kernel` cannot serve `call` (the end of a sentence that starts with its flag), or None."""
    if kernel in ("dense", "blockwise"):
        return None
    home = _HOME[kernel]
    if call.platform != home and not call.interpret:
        return f"runs on {home.upper()} only and this job runs on {call.platform.upper()}"
    if not call.causal or call.q_len != call.kv_len:
        return "serves causal self-attention only (queries and keys of one length)"
    if kernel == "cudnn":
        if call.packed and not call.interpret and (call.gpu_capability or 0) < PACKED_CUDNN_CAPABILITY:
            return (
                "masks packed documents (segment ids) on Hopper or later GPUs only (compute capability "
                f"{PACKED_CUDNN_CAPABILITY}); --attention=triton can"
            )
        if call.dtype not in ("bfloat16", "float16"):
            return f"needs bfloat16 or float16 activations, not {call.dtype}: set --dtype=bfloat16"
        if call.head_dim % 8 or call.head_dim > 128:
            return f"needs a head_dim that is a multiple of 8 and at most 128, not {call.head_dim}"
    if kernel == "triton" and call.head_dim > 256:
        return f"needs a head_dim of at most 256, not {call.head_dim}"
    if kernel == "triton" and call.window:
        return "has no sliding-window (local) attention; --attention=blockwise has"
    if kernel in ("cudnn", "triton") and call.softcap:
        return "has no attention-logit soft-capping; --attention=blockwise has"
    return None


def choose(kernel: str, call: Call) -> str:
    """The kernel that runs `call`: `kernel` itself if it can serve it (else one UsageError line), or
    for `auto` the first of the platform's kernels that can, then dense or blockwise."""
    if kernel not in KERNELS:
        raise UsageError(f"--attention={kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel != "auto":
        if reason := why_not(kernel, call):
            raise UsageError(f"--attention={kernel} {reason}; or use --attention=auto")
        return kernel
    profile = profile_for(call.platform)
    for name in profile.fused_attention:
        if why_not(name, call) is None:
            return name
    return "dense" if call.q_len < profile.dense_attention_below else "blockwise"


def default_platform() -> str:
    """The platform of the devices JAX runs on here ("cpu", "gpu" or "tpu")."""
    return jax.devices()[0].platform


def gpu_capability() -> float | None:
    """The compute capability of the first GPU JAX runs on (e.g. 9.0), or None where it runs on none."""
    device = jax.devices()[0]
    try:
        return float(device.compute_capability) if device.platform == "gpu" else None
    except (AttributeError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# The call
# --------------------------------------------------------------------------------------------


def attention(
    q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, causal=True,
    kernel: str = "auto", platform: str | None = None, layout: Layout | None = None, interpret: bool = False,
    max_documents: int = MAX_DOCUMENTS, window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """Attention by the kernel `choose` picks for `platform` (default: where JAX runs): [B,T,H,D] out.

    See the module docstring; the fused kernels read only `q_segment_ids` (self-attention) and no
    positions. `window` (sliding-window attention), `softcap` and `scale` as in
    `meshlm.ops.attention.dot_product_attention`. `layout`: the arrays' mesh and specs, for the kernels XLA cannot partition.
    `max_documents`: the most documents a row holds, for cuDNN's packed layout (`gpu.segment_offsets`)."""
    attn.check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    call = Call(
        platform=platform or default_platform(), q_len=q.shape[1], kv_len=k.shape[1], head_dim=q.shape[3],
        dtype=jnp.dtype(q.dtype).name, packed=q_segment_ids is not None, causal=bool(causal), interpret=interpret,
        window=int(window), softcap=float(softcap),
    )  # fmt: skip
    if call.platform == "gpu":
        call = call._replace(gpu_capability=gpu_capability())
    name = choose(kernel, call)
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, causal=causal)  # fmt: skip
    scores = dict(window=call.window, softcap=call.softcap, scale=scale)
    if name == "dense":
        return attn.dot_product_attention(q, k, v, **kw, **scores)
    if name == "blockwise":
        # Per shard, so that the blocks each device skips are decided from its own rows: partitioned by
        # XLA, every skip test would be an all-reduce over the batch's devices (a rendezvous per block).
        args = [q, k, v, q_positions, kv_positions] + ([q_segment_ids, kv_segment_ids] if call.packed else [])

        def local(q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None):
            return padded_blockwise(
                q, k, v, q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                causal=causal, **scores,
            )  # fmt: skip

        return _per_shard(local, args, layout, check_vma=True)
    return _fused(name, q, k, v, q_segment_ids, layout, interpret, max_documents, scores)


def padded_blockwise(
    q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, causal=True,
    window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """`blockwise_attention` on lengths padded to whole blocks of at most BLOCK tokens: padded keys get
    position -1 (masked), padded queries are dropped from the output."""
    t, s = q.shape[1], k.shape[1]
    (tp, bq), (sp, bk) = padded_length(t, BLOCK, 128), padded_length(s, BLOCK, 128)
    if t <= BLOCK:
        tp, bq = t, t  # one block: no padding needed
    if s <= BLOCK:
        sp, bk = s, s
    q, q_positions, q_segment_ids = (_pad(x, tp, 0) for x in (q, q_positions, q_segment_ids))
    k, v, kv_segment_ids = (_pad(x, sp, 0) for x in (k, v, kv_segment_ids))
    kv_positions = _pad(kv_positions, sp, -1)
    out = attn.blockwise_attention(
        q, k, v, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, causal=causal, block_q=bq, block_kv=bk, window=window, softcap=softcap,
        scale=scale,
    )  # fmt: skip
    return out[:, :t]


def _pad(x, length: int, value):
    """x [B, T, ...] padded with `value` to `length` along T (None stays None)."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _fused(name: str, q, k, v, segment_ids, layout: Layout | None, interpret: bool, max_documents: int, scores: dict):
    """Run one of the fused kernels on lengths padded to its blocks, per shard under a mesh. `scores`:
    window, softcap and scale (`why_not` has refused what the kernel cannot do)."""
    if name == "splash":
        from meshlm.ops.splash import MAX_BLOCK
        from meshlm.ops.splash import splash_attention as kernel

        tp, block = padded_length(q.shape[1], MAX_BLOCK, 128)
    elif name == "triton":
        from meshlm.ops.gpu import triton_attention as kernel
        from meshlm.ops.gpu import triton_block

        size = triton_block(q.dtype, q.shape[-1])
        tp, block = padded_length(q.shape[1], size, size)
    else:
        from meshlm.ops.gpu import cudnn_attention

        kernel = functools.partial(cudnn_attention, max_documents=max_documents)
        tp, block = q.shape[1], None
    # Causal masking keeps the padded keys (after every real query) unseen; padded queries are dropped.
    t = q.shape[1]
    q, k, v, segment_ids = (_pad(x, tp, 0) for x in (q, k, v, segment_ids))

    def local(q, k, v, segment_ids=None):
        return kernel(q, k, v, segment_ids, block=block, interpret=interpret, **scores)

    # Pallas calls declare no varying mesh axes for their outputs: check_vma cannot type them.
    args = [q, k, v] + ([] if segment_ids is None else [segment_ids])
    return _per_shard(local, args, layout, check_vma=False)[:, :t]


def _per_shard(local, args: list, layout: Layout | None, check_vma: bool):
    """`local(q, k, v, *per_token)` on each shard of a `shard_map` over the batch and head axes of `layout`
    (the arrays after k, v are [B, T] and laid out as the segment ids); called whole where nothing is split."""
    if layout is None or all(e is None for e in (*layout.q_spec, *layout.kv_spec)):
        return local(*args)
    q, k, v, *per_token = args
    q_spec, kv_spec = layout.q_spec, layout.kv_spec
    if tuple(q_spec)[2:3] != tuple(kv_spec)[2:3]:
        # Query heads split where kv heads are not: give each shard its query heads' own kv heads.
        group = q.shape[2] // k.shape[2]
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        kv_spec = q_spec
    specs = (q_spec, kv_spec, kv_spec) + (layout.seq_spec,) * len(per_token)
    sharded = jax.shard_map(local, mesh=layout.mesh, in_specs=specs, out_specs=q_spec, check_vma=check_vma)
    return sharded(q, k, v, *per_token)
