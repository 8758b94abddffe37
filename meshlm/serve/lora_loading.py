"""A LoRA run's checkpoint served: read by `meshlm.checkpoint.lora_checkpoint.LoraCheckpoint`, its base and
adapters merged on the serving mesh at load time (docs/lora.md).

    meta = lora_meta(path, step)                     # None: not a LoRA checkpoint
    params, carried = merged_params(job, path, step, meta, base=None)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.checkpoint.lora_checkpoint import LoraCheckpoint, lora_meta


def merged_params(job: Any, path: Path, step: int | None, meta: dict, base: str | Path | None = None):
    """(the merged parameters on `job.placement`, the tokenizer files to serve with). `base` replaces the
    base folder the run recorded (`--base=DIR`, when it has moved). The tokenizer is the run's, else the
    base's."""
    with LoraCheckpoint(path, step, base) as source:
        params = source.load(job.placement)
        own = source.run_files
        return params, (own if any(f.name == "tokenizer.json" for f in own) else source.carried)


__all__ = ["lora_meta", "merged_params"]
