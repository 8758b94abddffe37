"""Metric trackers: where a run's metrics go besides metrics.jsonl (`--tracker`).

- `tensorboard` (the default): TensorBoard event files in the run folder's `tb/`.
- `wandb`: a Weights & Biases run (the optional `wandb` package: pip install wandb). Its files go under
  the run folder; `WANDB_MODE=offline` keeps everything local (`wandb sync` uploads it later) and
  `WANDB_PROJECT` names the project (default: meshlm). A re-run of the same folder continues the same
  wandb run (its id is kept in `wandb_run_id`).
- `none`: metrics.jsonl and loss.png only.

    tracker = open_tracker("tensorboard", Path("outputs/run"), config=run_meta)
    tracker.log({"loss": 2.5, "eval/eval_loss": 2.7}, step=10)
    tracker.close()
"""

from __future__ import annotations

import os
from pathlib import Path

from meshlm.config import TRACKERS
from meshlm.errors import UsageError


class TensorBoardTracker:
    """Scalars into `<run>/tb` event files."""

    def __init__(self, output_dir: Path):
        from tensorboardX import SummaryWriter  # lazy: protobuf and its kin load only for --tracker=tensorboard

        self._writer = SummaryWriter(str(output_dir / "tb"))

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """Scalars into a Weights & Biases run whose files live under the run folder."""

    def __init__(self, output_dir: Path, config: dict | None = None, name: str | None = None):
        wandb = import_wandb()
        id_file = output_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "meshlm"),
            dir=str(output_dir),
            id=run_id,
            resume="allow",
            name=name or output_dir.name,
            config=config or {},
        )
        id_file.write_text(run_id + "\n")

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def import_wandb():
    """The `wandb` module, or one line saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise UsageError(
            "--tracker=wandb needs the wandb package: pip install wandb (or --tracker=tensorboard)"
        ) from None
    return wandb


def open_tracker(kind: str, output_dir: Path, *, config: dict | None = None, name: str | None = None):
    """The tracker `kind` names (`TRACKERS`), or None for `none`."""
    if kind == "none":
        return None
    if kind == "tensorboard":
        return TensorBoardTracker(output_dir)
    if kind == "wandb":
        return WandbTracker(output_dir, config, name)
    raise UsageError(f"--tracker={kind}: choose {', '.join(TRACKERS[:-1])} or {TRACKERS[-1]}")


__all__ = ["TRACKERS", "TensorBoardTracker", "WandbTracker", "import_wandb", "open_tracker"]
