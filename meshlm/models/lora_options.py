"""LoRA's options, checked without loading JAX: the weights adapted by default (`--lora_targets`) and
the checks of rank, alpha, targets and the base weights' dtype (`meshlm.models.lora` builds the adapters)."""

from __future__ import annotations

import re

from meshlm.errors import UsageError

# The attention and MLP projections of every layer.
DEFAULT_TARGETS = r"attn/w[qkvo]$|mlp/(gate|up|down)$"
BASE_DTYPES = ("float32", "bfloat16")  # the frozen base weights' dtype (bfloat16 halves their memory)


def check_lora(rank: int, alpha: float, targets: str, base_dtype: str) -> None:
    """The LoRA flags (also what `meshlm.models.lora.LoraSpec` checks): one line naming the fix."""
    if rank < 0:
        raise UsageError(f"--lora_rank={rank} must be ≥ 0 (0 turns LoRA off)")
    if alpha <= 0:
        raise UsageError(f"--lora_alpha={alpha} must be positive, e.g. 16")
    if base_dtype not in BASE_DTYPES:
        raise UsageError(f"--lora_base_dtype={base_dtype}: choose float32 or bfloat16")
    try:
        re.compile(targets)
    except re.error as e:
        raise UsageError(f"--lora_targets={targets!r} is not a regular expression ({e})") from None
