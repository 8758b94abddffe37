"""What the machine is: simulated CPU devices and the dtype `auto` means on each backend.

`configure_devices` must run before JAX initialises its backends (before the first device query);
everything here is small and imports JAX lazily so that the CLI can call it first.
"""

from __future__ import annotations

import os


def configure_devices(devices: int | None) -> None:
    """`--devices=N`: N simulated CPU devices (XLA's host device count), CPU only."""
    if devices is None:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def default_dtype(backend: str) -> str:
    """The compute dtype `auto` stands for: float32 on CPU (no fast bf16 matmuls there), bfloat16 on
    GPU and TPU."""
    return "float32" if backend == "cpu" else "bfloat16"


def resolve_dtype(dtype: str, backend: str | None = None) -> str:
    """`dtype` with `auto` replaced for `backend` (default: the backend JAX runs on here)."""
    if dtype != "auto":
        return dtype
    if backend is None:
        import jax

        backend = jax.default_backend()
    return default_dtype(backend)
