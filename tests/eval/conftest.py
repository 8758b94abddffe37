"""A checkpoint of the `test` preset (random float32 weights, a small byte-level tokenizer, as `meshlm
export` writes it) and a folder of local lm-eval tasks, made once per test session."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from tests.eval.local_tasks import write_tasks


def save_checkpoint(root: Path, preset: str, seed: int = 0) -> Path:
    """Random weights of `preset` with the byte-level `stdlib` tokenizer (512 entries) under root/PRESET."""
    from meshlm import mesh as meshlib
    from meshlm.checkpoint.convert import save_params
    from meshlm.data.tokenizer import train_tokenizer
    from meshlm.models.placement import place
    from meshlm.models.policy import RunPolicy
    from meshlm.models.presets import resolve_model

    cfg = resolve_model(preset)
    one = meshlib.build_mesh(meshlib.parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
    train_tokenizer("stdlib", 512, train_chars=400_000).save(root / "tokenizer")
    params = jax.device_get(place(cfg, one, policy=RunPolicy(dtype="float32", param_dtype="float32")).init(seed=seed))
    return save_params(params, cfg, root / preset, tokenizer_dir=root / "tokenizer")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("model"), "test")


@pytest.fixture(scope="session")
def tasks(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(include_path, {"mc": 20 questions × 4 choices, "rolling": documents of several windows, "gen": generation})."""
    folder = tmp_path_factory.mktemp("tasks")
    return folder, write_tasks(folder, mc_examples=20)
