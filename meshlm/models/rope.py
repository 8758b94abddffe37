"""Rotary position embedding: inverse frequencies (plain, or scaled as llama3, linear or yarn) and the rotation.

`rope_frequencies` runs in NumPy when the model is traced, so the frequencies are constants of the compiled
program. Both halves of each head rotate together ("rotate half"), the layout Hugging Face checkpoints use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.models.configs import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(inverse frequencies [D/2] float32, the factor cos and sin are multiplied by: 1 but for yarn)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32), 1.0
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32), 1.0
    if scaling.kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    return _llama3(inv, scaling).astype(np.float32), 1.0


def _llama3(inv: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Long wavelengths slowed by `factor`, short kept, a smooth blend between."""
    old = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return np.where(wavelen > low_wavelen, inv / scaling.factor, np.where(wavelen < high_wavelen, inv, blended))


def _yarn(inv: np.ndarray, head_dim: int, theta: float, scaling: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those turning more than `beta_fast` times kept, a linear ramp between."""

    def dim_turning(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: extrapolated (the frequency as trained), 0: interpolated
    out = inv / scaling.factor * (1 - kept) + inv * kept
    factor = scaling.attention_factor or (0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0)
    return out.astype(np.float32), float(factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> jax.Array:
    """Rotate [B, T, N, D] by position, halves convention (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin);
    `factor` scales cos and sin (yarn's attention factor)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


__all__ = ["rope_frequencies", "apply_rope"]
