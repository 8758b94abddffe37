"""A saved step carries a checksum per file, verified before a restore; a save that fills the disk and a
truncated legacy checkpoint are one line each."""

import errno
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from meshlm.checkpoint import checksums
from meshlm.checkpoint.manager import Checkpointer, error_line
from meshlm.errors import UsageError

STATE = {"params": {"w": jnp.arange(4096, dtype=jnp.float32)}, "step": jnp.int32(0)}


def abstract():
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), STATE)


def save_steps(directory, steps=(1, 2)):
    ckpt = Checkpointer(directory)
    for step in steps:
        ckpt.save(step, jax.tree.map(lambda a, step=step: a + step, STATE), {"position": step}, {"seed": 0})
    ckpt.close()


def largest_array_file(step_dir):
    return max(
        (f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
        key=lambda f: f.stat().st_size,
    )


def flip_64_bytes(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    save_steps(directory)
    return directory


@pytest.fixture
def flipped(saved, tmp_path):
    directory = shutil.copytree(saved, tmp_path / "checkpoints")
    bad = largest_array_file(directory / "2")
    flip_64_bytes(bad)
    return directory, bad.relative_to(directory / "2").as_posix()


def test_every_saved_step_records_its_files(saved):
    for step in (1, 2):
        assert (saved / str(step) / checksums.FILE).is_file()
        assert checksums.first_mismatch(saved / str(step)) is None
    state, data, _ = Checkpointer(saved).restore(abstract())
    assert int(state["params"]["w"][1]) == 3 and data == {"position": 2}


def test_flipped_bytes_name_the_file_and_the_step_that_verifies(flipped):
    directory, name = flipped
    with pytest.raises(UsageError) as err:
        Checkpointer(directory).restore(abstract())
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and name in msg and "checksum" in msg, msg
    assert f"{directory / '2'} is incomplete or corrupt" in msg and "resume from step 1" in msg, msg


def test_the_step_named_instead_verifies_too(flipped):
    directory, _ = flipped
    flip_64_bytes(largest_array_file(directory / "1"))
    with pytest.raises(UsageError) as err:
        Checkpointer(directory).restore(abstract())
    assert "no earlier checkpoint there is intact" in str(err.value) and "step 1" not in str(err.value), err.value


def test_the_weight_reader_refuses_flipped_bytes(flipped):
    """What serve, generate, export and convert open: one line naming the file and a --step that verifies."""
    from meshlm.checkpoint.train_checkpoint import TrainCheckpoint

    directory, name = flipped
    with pytest.raises(UsageError) as err:
        TrainCheckpoint(directory)
    assert name in str(err.value) and "pass --step=1" in str(err.value), err.value


def test_disk_full_during_a_save_is_one_line(tmp_path, monkeypatch, capfd):
    import orbax.checkpoint as ocp

    directory = tmp_path / "checkpoints"
    save_steps(directory, steps=(1,))

    async def no_space(self, x, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", no_space)
    ckpt = Checkpointer(directory)
    with pytest.raises(UsageError) as err:
        ckpt.save(2, STATE, {"position": 2}, {"seed": 0})
        ckpt.close()
    assert str(err.value).startswith(
        f"no space left on device writing {directory / '2'}; the last complete checkpoint is 1;"
    ), err.value
    assert "Traceback" not in capfd.readouterr().err
    assert Checkpointer(directory).latest_step() == 1


def test_truncated_checkpoint_without_checksums_is_one_line_without_a_method_repr(saved, tmp_path, capfd):
    """A checkpoint saved before checksums were recorded: Orbax's read error wraps TensorStore's with the
    repr of a method; the line gives TensorStore's own reason."""
    directory = shutil.copytree(saved, tmp_path / "checkpoints")
    (directory / "2" / checksums.FILE).unlink()
    for f in (directory / "2" / "state" / "ocdbt.process_0" / "d").iterdir():  # the array chunks
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(UsageError) as err:
        Checkpointer(directory).restore(abstract())
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "bound method" not in msg and "resume from step 1" in msg, msg
    assert "Traceback" not in capfd.readouterr().err


def test_error_line_gives_the_store_error_under_orbax_wrapper():
    wrapper = (
        "Encountered error while reading array index: (slice(0, 2, 1),). See full TensorStore "
        "details: <bound method pybind11_detail_function_record_v1_system_libstdcpp of spec>."
    )
    try:
        try:
            raise ValueError('OUT_OF_RANGE: Error reading "params.w/0"\nmore detail')
        except ValueError:
            raise Exception(wrapper)  # noqa: B904 (Orbax's wrapper chains implicitly, as here)
    except Exception as e:  # noqa: BLE001
        line = error_line(e)
    assert line == 'ValueError: OUT_OF_RANGE: Error reading "params.w/0"', line
