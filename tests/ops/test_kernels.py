"""The attention dispatch: which kernel each backend gets, the one-line refusals of a forced kernel,
lengths padded instead of a silent dense fallback, and the GPU kernels' numerics (Triton in Pallas
interpret mode, cuDNN's call as its XLA twin) and a sharded fused kernel, against the blockwise one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.config import TrainConfig
from meshlm.errors import UsageError
from meshlm.ops import attention as attn
from meshlm.ops import gpu, kernels
from meshlm.ops.kernels import Call, choose
from tests.ops.test_splash import ATOL, _problem, _value_and_grads


def _call(platform, t=4096, dtype="bfloat16", packed=False, head_dim=128, causal=True):
    return Call(platform=platform, q_len=t, kv_len=t, head_dim=head_dim, dtype=dtype, packed=packed, causal=causal)


@pytest.mark.parametrize(
    "call, expected",
    [
        (_call("tpu"), "splash"),
        (_call("tpu", packed=True, dtype="float32", t=100), "splash"),
        (_call("gpu"), "cudnn"),
        (_call("gpu", packed=True), "triton"),  # cuDNN's packed layout needs a Hopper GPU (capability unknown)
        (_call("gpu", packed=True)._replace(gpu_capability=8.0), "triton"),
        (_call("gpu", packed=True)._replace(gpu_capability=9.0), "cudnn"),
        (_call("gpu", dtype="float32"), "triton"),  # cuDNN needs 16-bit activations
        (_call("cpu", t=128), "dense"),
        (_call("cpu", t=256), "blockwise"),
        (_call("cpu", t=1100), "blockwise"),
        (_call("tpu", causal=False), "blockwise"),  # the fused kernels serve causal self-attention only
        (_call("tpu")._replace(window=1024, softcap=50.0), "splash"),  # LocalMask and its soft cap
        (_call("gpu")._replace(window=1024), "cudnn"),  # cuDNN's sliding window
        (_call("gpu")._replace(softcap=50.0), "blockwise"),  # neither GPU kernel soft-caps
        (_call("gpu", dtype="float32")._replace(window=1024), "blockwise"),  # Triton has no window
        (_call("cpu", t=128)._replace(window=64, softcap=50.0), "dense"),
    ],
)
def test_auto_picks_the_backends_kernel(call, expected):
    assert choose("auto", call) == expected


@pytest.mark.parametrize(
    "kernel, call, words",
    [
        ("splash", _call("cpu"), "runs on TPU only"),
        ("triton", _call("tpu"), "runs on GPU only"),
        ("cudnn", _call("gpu", packed=True)._replace(gpu_capability=8.0), "packed documents (segment ids) on Hopper"),
        ("cudnn", _call("gpu", dtype="float32"), "set --dtype=bfloat16"),
        ("cudnn", _call("gpu", head_dim=192), "head_dim"),
        ("flash", _call("gpu"), "choose one of auto"),
        ("triton", _call("gpu")._replace(window=4096), "has no sliding-window (local) attention"),
        ("cudnn", _call("gpu")._replace(softcap=50.0), "has no attention-logit soft-capping"),
        ("triton", _call("gpu")._replace(softcap=50.0), "has no attention-logit soft-capping"),
    ],
)
def test_forced_kernel_that_cannot_serve_says_so_in_one_line(kernel, call, words):
    with pytest.raises(UsageError) as e:
        choose(kernel, call)
    assert words in str(e.value) and "--attention=" in str(e.value) and "\n" not in str(e.value)


def test_forced_kernels_that_can_serve_are_kept():
    assert choose("blockwise", _call("tpu")) == "blockwise"
    assert choose("dense", _call("gpu")) == "dense"
    assert choose("splash", _call("tpu", packed=True)) == "splash"


def test_flag_is_checked_with_the_precision_flags():
    with pytest.raises(UsageError, match="--attention='flash': choose one of auto"):
        TrainConfig(attention="flash").validate()


def test_padded_length():
    assert kernels.padded_length(8192, 512, 128) == (8192, 512)
    assert kernels.padded_length(8000, 512, 128) == (8192, 512)
    assert kernels.padded_length(1030, 512, 128) == (1152, 384)
    assert kernels.padded_length(100, 512, 128) == (128, 128)


def test_long_length_off_the_block_is_padded_not_dense(monkeypatch):
    """T >= 1024 with T % 512 != 0 runs blockwise on padded blocks (never the O(T^2) kernel), same
    value and gradients as the dense reference."""
    q, k, v, pos, seg, dout = _problem([[600, 500], [1100]], heads=2, kv_heads=1, head_dim=16)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    ref = _value_and_grads(lambda q, k, v: attn.dot_product_attention(q, k, v, **kw), q, k, v, dout)

    def no_dense(*a, **k):
        raise AssertionError("dense attention at T=1100")

    monkeypatch.setattr(attn, "dot_product_attention", no_dense)
    got = _value_and_grads(lambda q, k, v: kernels.attention(q, k, v, **kw, platform="cpu"), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)


def test_triton_equals_blockwise_in_interpret_mode():
    """The Pallas GPU kernel (packed documents, grouped queries via repeated kv heads, padding)."""
    q, k, v, pos, seg, dout = _problem([[90, 60, 50], [150, 50]])
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    ref = _value_and_grads(lambda q, k, v: attn.blockwise_attention(q, k, v, **kw, block_q=200, block_kv=200),
                           q, k, v, dout)  # fmt: skip
    got = _value_and_grads(
        lambda q, k, v: kernels.attention(q, k, v, **kw, kernel="triton", platform="gpu", interpret=True),
        q, k, v, dout,
    )  # fmt: skip
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)


def test_cudnn_call_equals_blockwise():
    """The arguments given to cuDNN's call (causal, GQA, scale), checked through its XLA twin."""
    q, k, v, pos, _, dout = _problem([[128], [128]])
    pos = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), pos.shape)
    ref = _value_and_grads(
        lambda q, k, v: attn.blockwise_attention(q, k, v, q_positions=pos, kv_positions=pos), q, k, v, dout
    )
    got = _value_and_grads(lambda q, k, v: gpu.cudnn_attention(q, k, v, interpret=True), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)
    # Through the dispatch in bfloat16, the dtype cuDNN takes.
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = kernels.attention(*bf, q_positions=pos, kv_positions=pos, kernel="cudnn", platform="gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref[0]), atol=0.05)


def test_cudnn_packed_call_equals_blockwise():
    """With segment ids, cuDNN's call masks packed documents (checked through its XLA twin; on a GPU,
    tests/ops/test_gpu_kernels.py runs cuDNN's packed layout itself)."""
    q, k, v, pos, seg, dout = _problem([[60, 40, 28], [100, 28]])
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    ref = _value_and_grads(lambda q, k, v: attn.blockwise_attention(q, k, v, **kw, block_q=128, block_kv=128),
                           q, k, v, dout)  # fmt: skip
    got = _value_and_grads(lambda q, k, v: gpu.cudnn_attention(q, k, v, seg, interpret=True), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]  # through the dispatch, in the dtype cuDNN takes
    out = kernels.attention(*bf, **kw, kernel="cudnn", platform="gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref[0]), atol=0.05)


@pytest.mark.parametrize("kv_heads_split", [True, False], ids=["kv_heads_split", "kv_heads_whole"])
def test_fused_kernel_runs_per_shard_on_a_mesh(kv_heads_split):
    """Under jit on a (fsdp=4, tp=2) mesh the fused kernel runs in a shard_map over batch and heads;
    with kv heads left whole while query heads split, each shard gets its own kv heads."""
    q, k, v, pos, seg, dout = _problem([[60, 68]] * 4, heads=4, kv_heads=2, head_dim=16)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
    layout = kernels.Layout(
        mesh, P("fsdp", None, "tp", None), P("fsdp", None, "tp" if kv_heads_split else None, None), P("fsdp", None)
    )
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    ref = _value_and_grads(lambda q, k, v: attn.dot_product_attention(q, k, v, **kw), q, k, v, dout)
    place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    q, dout = place(q, layout.q_spec), place(dout, layout.q_spec)
    k, v = place(k, layout.kv_spec), place(v, layout.kv_spec)

    @jax.jit
    def run(q, k, v, dout):
        fn = lambda q, k, v: kernels.attention(  # noqa: E731
            q, k, v, **kw, kernel="splash", platform="tpu", layout=layout, interpret=True
        )
        return _value_and_grads(fn, q, k, v, dout)

    got = run(q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)


SCORES = dict(window=70, scale=0.3)  # what the GPU kernels can do of a local layer


def test_cudnn_window_and_scale_equal_blockwise():
    """cuDNN's local window (W-1, 0) and scale, plain and over packed documents, through its XLA twin."""
    q, k, v, pos, seg, dout = _problem([[60, 40, 28], [100, 28]])
    for segments in (None, seg):
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=segments, kv_segment_ids=segments)
        if segments is None:
            kw.update(q_positions=jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), pos.shape))
            kw.update(kv_positions=kw["q_positions"])
        ref = _value_and_grads(lambda q, k, v, kw=kw: attn.blockwise_attention(q, k, v, **kw, **SCORES), q, k, v, dout)
        got = _value_and_grads(
            lambda q, k, v, seg=segments: gpu.cudnn_attention(q, k, v, seg, interpret=True, **SCORES), q, k, v, dout
        )
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)


def test_triton_scale_equals_blockwise_and_refuses_a_window():
    """The Triton kernel takes the scale (sm_scale); it has no window or soft cap and says so."""
    q, k, v, pos, seg, dout = _problem([[70, 58]], heads=2, kv_heads=1, head_dim=16)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, scale=0.3)
    ref = _value_and_grads(lambda q, k, v: attn.blockwise_attention(q, k, v, **kw), q, k, v, dout)
    got = _value_and_grads(
        lambda q, k, v: kernels.attention(q, k, v, **kw, kernel="triton", platform="gpu", interpret=True),
        q, k, v, dout,
    )  # fmt: skip
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)
    with pytest.raises(UsageError, match="--attention=triton has no sliding-window"):
        kernels.attention(q, k, v, **kw, kernel="triton", platform="gpu", interpret=True, window=16)


def test_padded_blockwise_window_softcap_equal_dense():
    """The CPU dispatch's blockwise kernel (one block of 300: no conditionals) with a window, a soft cap
    and a scale over packed documents: the dense reference's values and gradients."""
    q, k, v, pos, seg, dout = _problem([[200, 100]], heads=2, kv_heads=1, head_dim=16)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    kw.update(window=50, softcap=2.0, scale=0.3)
    ref = _value_and_grads(lambda q, k, v: attn.dot_product_attention(q, k, v, **kw), q, k, v, dout)
    got = _value_and_grads(lambda q, k, v: kernels.attention(q, k, v, **kw, kernel="blockwise"), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)
