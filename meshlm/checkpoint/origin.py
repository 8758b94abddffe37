"""Which Hugging Face folder a meshlm params folder was converted from.

`meshlm convert --from_hf=DIR --out=P` records DIR (absolute) in P/converted_from.json, so that tools which
need the Hugging Face weights themselves (a PEFT adapter's `base_model_name_or_path`) can name them for a
run that trained on P. `hf_base` turns any base a run records into such a folder, or says which to give.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.checkpoint.folders import CONFIG_FILE
from meshlm.checkpoint.params_folder import is_params_folder
from meshlm.errors import UsageError

ORIGIN_FILE = "converted_from.json"


def record_origin(params_dir: str | Path, hf_dir: str | Path) -> Path:
    """Write P/converted_from.json naming the Hugging Face folder P was converted from."""
    path = Path(params_dir) / ORIGIN_FILE
    path.write_text(json.dumps({"hf": str(Path(hf_dir).expanduser().absolute())}, indent=2) + "\n")
    return path


def converted_from(params_dir: str | Path) -> Path | None:
    """The Hugging Face folder a params folder was converted from, if recorded and still there."""
    try:
        hf = Path(json.loads((Path(params_dir) / ORIGIN_FILE).read_text())["hf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return hf if is_hf_folder(hf) else None


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: config.json and safetensors weights, not a meshlm params folder."""
    return (
        path.is_dir()
        and (path / CONFIG_FILE).is_file()
        and not is_params_folder(path)
        and any(path.glob("*.safetensors"))
    )


def hf_base(base: str | Path, flag: str = "--base") -> str:
    """The absolute Hugging Face folder for a base given as `base`: itself, or the folder a params folder was
    converted from. Anything else (a params folder with no recorded origin, a training run) is one line
    naming the `flag` to give."""
    path = Path(base).expanduser()
    if is_hf_folder(path):
        return str(path.absolute())
    origin = converted_from(path) if is_params_folder(path) else None
    if origin is not None:
        return str(origin)
    raise UsageError(
        f"the base {path} is not a Hugging Face folder, which PEFT needs to load the adapters onto: give "
        f"{flag}=DIR, the Hugging Face folder it came from (or make one with `meshlm convert "
        f"--to_hf=DIR --checkpoint={path}`)"
    )


__all__ = ["ORIGIN_FILE", "record_origin", "converted_from", "is_hf_folder", "hf_base"]
