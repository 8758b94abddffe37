"""The decode step's attention against a KV cache equals the plain reference with the same mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.ops.attention import dot_product_attention
from meshlm.ops.decode import decode_attention


@pytest.mark.parametrize("t, h, kvh", [(1, 4, 2), (1, 4, 4), (3, 8, 2)])
def test_decode_attention_equals_the_reference(t, h, kvh):
    """Rows at different positions; slots past a row's newest token are empty (position -1) and so
    are never attended, whatever they hold."""
    rng = np.random.default_rng(0)
    b, s, d = 3, 16, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kvh, d)), jnp.float32) for _ in range(2))
    newest = np.array([4, 9, 15])
    q_pos = jnp.asarray(newest[:, None] - np.arange(t)[::-1], jnp.int32)  # the last t tokens of each row
    slots = np.arange(s)
    kv_pos = jnp.asarray(np.where(slots[None] <= newest[:, None], slots[None], -1), jnp.int32)
    got = decode_attention(q, k, v, q_pos, kv_pos)
    want = dot_product_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos)
    np.testing.assert_allclose(got, want, atol=1e-5)
    garbage = k.at[0, 5:].set(1e3)  # row 0 fills slots 0..4 only
    np.testing.assert_allclose(decode_attention(q, garbage, v, q_pos, kv_pos), got, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(window=3), dict(window=5, softcap=2.0, scale=0.3)], ids=["window", "all"])
def test_decode_window_softcap_scale_equal_the_reference(kw):
    """A sliding window over the cache (slots more than W - 1 positions behind are not attended),
    soft-capped scores and a custom scale: the same as the reference with the same arguments."""
    rng = np.random.default_rng(1)
    b, s, t, h, kvh, d = 2, 16, 2, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kvh, d)), jnp.float32) for _ in range(2))
    newest = np.array([6, 13])
    q_pos = jnp.asarray(newest[:, None] - np.arange(t)[::-1], jnp.int32)
    slots = np.arange(s)
    kv_pos = jnp.asarray(np.where(slots[None] <= newest[:, None], slots[None], -1), jnp.int32)
    got = decode_attention(q, k, v, q_pos, kv_pos, **kw)
    want = dot_product_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, **kw)
    np.testing.assert_allclose(got, want, atol=1e-5)
    far = k.at[1, : newest[1] - t + 2 - kw["window"]].set(1e3)  # row 1: slots behind every window: garbage
    np.testing.assert_allclose(decode_attention(q, far, v, q_pos, kv_pos, **kw), got, atol=1e-5)
