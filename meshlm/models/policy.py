"""How a run runs a model: the `RunPolicy` dataclass (precision, remat, attention kernel, loss chunks, layer
loop unrolling, cuDNN's packed documents), apart from what the model is (`meshlm.models.configs.ModelConfig`).

`meshlm.job` fills it from --dtype, --param_dtype, --remat, --attention and the `--model.FIELD` overrides
named in `OVERRIDES`; `meshlm.models.placement.place` takes it beside the model's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshlm.errors import UsageError
from meshlm.models.remat import POLICIES as REMAT_POLICIES

# The fields still set as `--model.FIELD=VALUE` (the others are flags of their own: --dtype, --remat, ...).
OVERRIDES = ("loss_chunk", "scan_unroll", "max_documents")


@dataclass(frozen=True)
class RunPolicy:
    """Numerics and execution choices of one run of a model; none changes its shapes or its weights' names."""

    dtype: str = "bfloat16"  # compute dtype of matmuls; softmax and loss are always float32
    param_dtype: str = "float32"
    # see meshlm.models.remat; `auto`: the job's choice (`meshlm.job.auto_remat`), resolved before building
    remat: str = "none"
    attention: str = "auto"  # attention kernel, see meshlm.ops.kernels
    # Training loss: positions of each row whose float32 logits exist at once (meshlm.models.loss);
    # 0: the whole sequence in one piece.
    loss_chunk: int = 1024
    # Layers per iteration of the training layer loop (a lax.scan): 1 keeps one compiled layer;
    # n_layers unrolls the loop into straight-line code (longer compiles, no per-layer loop overhead);
    # 0: auto, n_layers on GPU (8 llama3-8b layers on an H200: 9% faster, 13 GiB less), 1 elsewhere.
    scan_unroll: int = 0
    # cuDNN attention over packed documents (GPU): the most documents one row holds. Its workspace grows
    # with it ([rows x max_documents, T, heads, head_dim] float32); in a row with more, the documents
    # from the max_documents-th on attend to each other (`meshlm train` warns when a batch has one).
    max_documents: int = 8

    def __post_init__(self):
        if self.remat not in (*REMAT_POLICIES, "auto"):
            raise UsageError(f"--remat={self.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        if self.loss_chunk < 0:
            raise UsageError(f"--model.loss_chunk={self.loss_chunk}: give positions per loss chunk, or 0 for none")
        if self.scan_unroll < 0:
            raise UsageError(f"--model.scan_unroll={self.scan_unroll}: give layers per loop iteration, or 0 for auto")
        if self.max_documents < 1:
            raise UsageError(f"--model.max_documents={self.max_documents} must be a positive integer")

    def replace(self, **changes) -> RunPolicy:
        return dataclasses.replace(self, **changes)


DEFAULT_POLICY = RunPolicy()
FIELDS = tuple(f.name for f in dataclasses.fields(RunPolicy))


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`--model.FIELD=VALUE` overrides -> (the model's, the policy's: the keys in `OVERRIDES`)."""
    model = {k: v for k, v in overrides.items() if k not in OVERRIDES}
    return model, {k: v for k, v in overrides.items() if k in OVERRIDES}


def apply_overrides(base: RunPolicy, overrides: dict[str, Any]) -> RunPolicy:
    """The policy's `--model.FIELD=VALUE` overrides (integers), each checked as the dataclass checks it."""
    changes = {}
    for key, raw in overrides.items():
        if key not in OVERRIDES:
            raise UsageError(f"--model.{key}: not a run policy field; known: {', '.join(OVERRIDES)}")
        try:
            changes[key] = int(raw)
        except ValueError:
            raise UsageError(f"--model.{key}={raw!r} is not a valid int") from None
    return dataclasses.replace(base, **changes)


def from_saved(saved: dict[str, Any], base: RunPolicy | None = None) -> RunPolicy:
    """A policy from a saved model dict of an older run (which held these fields): the fields it has."""
    found = {k: saved[k] for k in FIELDS if k in saved}
    return dataclasses.replace(base or RunPolicy(), **found)


__all__ = ["DEFAULT_POLICY", "FIELDS", "OVERRIDES", "RunPolicy", "apply_overrides", "from_saved", "split_overrides"]
