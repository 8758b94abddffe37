"""The GPU attention kernels on a real GPU, against the blockwise kernel in float32: cuDNN flash attention
(causal, grouped queries), cuDNN over packed documents (segment ids as cuDNN's per-document offsets) and
the Pallas (Triton) kernel, output and gradients. Skipped, with the reason printed, where JAX has no GPU
(CI): there, tests/ops/test_kernels.py checks the same calls in interpret mode, and the offsets below.
On a GPU machine: `JAX_PLATFORMS=cuda pytest tests/ops/test_gpu_kernels.py` (tests/conftest.py would
otherwise pick the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.ops import gpu, kernels
from tests.ops.test_splash import _problem as _splash_problem
from tests.ops.test_splash import _value_and_grads


def _problem(lengths_per_row):
    """q, k, v, positions, segment ids, cotangent at a GPU-sized head: 8 query / 2 kv heads of 128."""
    return _splash_problem(lengths_per_row, heads=8, kv_heads=2, head_dim=128)


ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (JAX's default backend here is not gpu)")


def _relative_errors(got, ref):
    return {name: float(jnp.linalg.norm(jnp.asarray(a, jnp.float32) - b) / jnp.linalg.norm(b))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}  # fmt: skip


def _reference(q, k, v, pos, seg, dout):
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    return _value_and_grads(lambda q, k, v: kernels.padded_blockwise(q, k, v, **kw), q, k, v, dout)


def test_segment_offsets():
    """Documents start where the id changes; -1 past a row's last; a row over M merges its tail."""
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3], [1] * 8, [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    seqlens, offsets = gpu.segment_offsets(seg, 4)
    np.testing.assert_array_equal(seqlens, [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 1, 5]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, -1]])


@needs_gpu
def test_cudnn_equals_blockwise_on_gpu():
    q, k, v, _, _, dout = _problem([[1024], [1024]])
    pos = jnp.broadcast_to(jnp.arange(1024, dtype=jnp.int32), (2, 1024))
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    ref = _reference(*(x.astype(jnp.float32) for x in bf), pos, None, dout)
    got = _value_and_grads(lambda q, k, v: gpu.cudnn_attention(q, k, v), *bf, dout.astype(jnp.bfloat16))
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < 2e-2, errors


@needs_gpu
def test_cudnn_packed_equals_blockwise_on_gpu():
    q, k, v, pos, seg, dout = _problem([[300, 500, 224], [1024]])
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    ref = _reference(*(x.astype(jnp.float32) for x in bf), pos, seg, dout)
    got = _value_and_grads(lambda q, k, v: gpu.cudnn_packed_attention(q, k, v, seg), *bf, dout.astype(jnp.bfloat16))
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < 2e-2, errors


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_equals_blockwise_on_gpu(dtype):
    q, k, v, pos, seg, dout = _problem([[300, 500, 224], [1024]])
    xs = [x.astype(dtype) for x in (q, k, v)]
    ref = _reference(*(x.astype(jnp.float32) for x in xs), pos, seg, dout)
    got = _value_and_grads(
        lambda q, k, v: kernels.attention(
            q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, kernel="triton"
        ),
        *xs,
        dout.astype(dtype),
    )
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < (5e-3 if dtype == "float32" else 2e-2), errors


@needs_gpu
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_cudnn_window_equals_blockwise_on_gpu(packed):
    """cuDNN's sliding window (and a custom scale), unpacked and in its packed-document layout."""
    q, k, v, pos, seg, dout = _problem([[300, 500, 224], [1024]] if packed else [[1024], [1024]])
    if not packed:
        pos, seg = jnp.broadcast_to(jnp.arange(1024, dtype=jnp.int32), (2, 1024)), None
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    scores = dict(window=200, scale=0.05)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, **scores)
    f32 = [x.astype(jnp.float32) for x in bf]
    ref = _value_and_grads(lambda q, k, v: kernels.padded_blockwise(q, k, v, **kw), *f32, dout)
    got = _value_and_grads(lambda q, k, v: gpu.cudnn_attention(q, k, v, seg, **scores), *bf, dout.astype(jnp.bfloat16))
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < 2e-2, errors
