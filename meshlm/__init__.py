"""meshlm: train and serve LLaMA-family models on any dp, fsdp, tp, sp device mesh with JAX."""

__version__ = "0.1.0"
