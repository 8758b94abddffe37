"""The run configuration: sections composed as fields, flags read and set through them, checked once."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.config import BatchConfig, TrainConfig, flag_fields
from meshlm.config.sections import SECTIONS
from meshlm.errors import UsageError


def test_sections_are_fields_and_flags_read_through_them():
    cfg = TrainConfig(model="tiny", batch_size=16)
    assert isinstance(cfg.batch, BatchConfig) and cfg.batch.batch_size == cfg.batch_size == 16
    cfg.seq_len = 64
    assert cfg.batch.seq_len == 64 and cfg.source.model == "tiny"
    assert not any(issubclass(TrainConfig, s) for s in SECTIONS.values())  # composition, not inheritance
    with pytest.raises(TypeError, match="no_such_flag"):
        TrainConfig(no_such_flag=1)


def test_sections_given_are_copied_and_replace_keeps_the_original():
    batch = BatchConfig(batch_size=4)
    cfg = TrainConfig(batch=batch, grad_accum=2)
    assert (cfg.batch_size, cfg.grad_accum, batch.grad_accum) == (4, 2, 1)
    changed = dataclasses.replace(cfg, batch_size=8)
    assert (changed.batch_size, cfg.batch_size) == (8, 4)


def test_as_flags_is_one_flat_dict_of_every_field():
    flat = TrainConfig(lr=1e-3).as_flags()
    assert list(flat) == [f.name for f in flag_fields()] and flat["lr"] == 1e-3


def test_validate_checks_each_set_of_values_once(monkeypatch):
    calls = []
    monkeypatch.setattr(BatchConfig, "check", lambda self, run=None: calls.append(self.batch_size))
    cfg = TrainConfig()
    cfg.validate(), cfg.validate()
    assert calls == [8]
    cfg.batch_size = 16
    cfg.validate()
    assert calls == [8, 16]


def test_checks_across_sections_read_the_whole_run():
    with pytest.raises(UsageError, match="--lora_rank with --pp"):
        TrainConfig(lora_rank=4, pp=2).validate()
    with pytest.raises(UsageError, match="starts after the last step"):
        TrainConfig(steps=3, profile_steps="5:6").validate()


def test_copies_and_pickles_keep_every_section():
    import copy
    import pickle

    cfg = TrainConfig(lr=1e-3, model_overrides={"n_layers": "2"})
    for twin in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert twin.as_flags() == cfg.as_flags() and twin.batch is not cfg.batch
