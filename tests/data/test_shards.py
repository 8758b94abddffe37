"""Token shards: a folder of .npy units read back as one stream, across unit boundaries, with its checks."""

import errno
import json
import os

import numpy as np
import pytest

from meshlm.data import shards as shards_module
from meshlm.data.shards import FORMAT, MANIFEST, DamagedShard, GrowingNpy, TokenShards, unit_stem
from meshlm.errors import UsageError


def write_shards(folder, pieces, dtype=np.uint16, vocab_size=1000):
    """A prepared folder whose units hold `pieces` (lists of ids), each one document."""
    folder.mkdir(parents=True, exist_ok=True)
    units = []
    for i, ids in enumerate(pieces):
        out = GrowingNpy(folder / f"{unit_stem(i)}.npy", dtype)
        for half in (ids[: len(ids) // 2], ids[len(ids) // 2 :]):  # appended a chunk at a time
            out.append(np.asarray(half))
        out.close()
        np.save(folder / f"{unit_stem(i)}.docs.npy", np.array([len(ids)], np.int64))
        units.append({"stem": unit_stem(i), "label": f"f{i % 2}", "documents": 1, "tokens": len(ids), "bytes": 9})
    manifest = {"format": FORMAT, "corpus": "c", "dtype": np.dtype(dtype).str, "vocab_size": vocab_size, "units": units}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return TokenShards(folder)


def test_growing_npy_is_a_plain_npy(tmp_path):
    out = GrowingNpy(tmp_path / "a.npy", np.uint32)
    for chunk in (np.arange(5), np.arange(0), np.arange(70000, 70003)):
        out.append(chunk)
    out.close()
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), [0, 1, 2, 3, 4, 70000, 70001, 70002])


def test_slices_read_across_unit_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 1000, n).tolist() for n in (7, 1, 0, 12, 5)]
    whole = np.concatenate([np.asarray(p, np.uint16) for p in pieces])
    shards = write_shards(tmp_path / "s", pieces)
    assert len(shards) == len(whole) and shards.dtype == np.uint16
    for a in range(len(whole) + 1):
        for b in (a, a + 1, a + 6, a + 13, len(whole) + 3):
            got = shards[a:b]
            assert isinstance(got, np.ndarray)
            np.testing.assert_array_equal(got, whole[a:b])
    np.testing.assert_array_equal(shards[-4:], whole[-4:])
    np.testing.assert_array_equal(shards[1:20:3], whole[1:20:3])
    assert shards[8] == whole[8] and shards[-1] == whole[-1]
    with pytest.raises(IndexError):
        shards[len(whole)]
    np.testing.assert_array_equal(np.asarray(shards), whole)
    shards.ensure_intact()
    assert shards.documents == 5
    assert shards.tokens_per_source() == {"f0": (3, 7 + 0 + 5), "f1": (2, 1 + 12)}


def test_a_damaged_unit_is_named(tmp_path):
    write_shards(tmp_path / "s", [[1, 2, 3], [4, 5, 6, 7]])
    with open(tmp_path / "s" / f"{unit_stem(1)}.npy", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    with pytest.raises(DamagedShard) as e:
        TokenShards(tmp_path / "s")
    assert e.value.stem == unit_stem(1)


def test_ids_beyond_the_vocabulary_stop_the_read_that_meets_them(tmp_path):
    """Opening reads no ids (a corpus of any size opens at once); a read meeting a bad id is one line."""
    shards = write_shards(tmp_path / "s", [[1, 2], [3, 999]], vocab_size=500)
    np.testing.assert_array_equal(shards[0:3], [1, 2, 3])
    with pytest.raises(UsageError, match=f"{unit_stem(1)}.npy holds id 999, outside .* vocabulary of 500; delete"):
        shards[1:4]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_opening_keeps_no_file_open_and_reads_keep_a_bounded_number(tmp_path, monkeypatch):
    """Hundreds of units must not exhaust the descriptor limit: opening holds none, reads at most OPEN_UNITS."""
    monkeypatch.setattr(shards_module, "OPEN_UNITS", 3)
    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 1000, 4 + i % 3).tolist() for i in range(40)]
    whole = np.concatenate([np.asarray(p, np.uint16) for p in pieces])
    before = open_fds()
    shards = write_shards(tmp_path / "s", pieces)
    assert open_fds() == before
    most = 0
    for a in range(0, len(whole), 3):  # every unit, in order, each read spanning one or two
        np.testing.assert_array_equal(shards[a : a + 7], whole[a : a + 7])
        shards.ensure_intact()
        assert len(shards._open) <= 3
        most = max(most, open_fds() - before)
    assert 0 < most <= 2 * 3
    np.testing.assert_array_equal(np.asarray(shards), whole)
    assert open_fds() - before <= 2 * 3


def test_too_many_open_files_is_one_line_and_not_damage(tmp_path, monkeypatch):
    """EMFILE is not a damaged unit (which would be deleted and encoded again): one line naming ulimit -n."""
    write_shards(tmp_path / "s", [[1, 2, 3], [4, 5]])

    def no_descriptors(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as m:
        m.setattr(shards_module, "read_stream_header", no_descriptors)
        with pytest.raises(UsageError, match=r"too many open files .*ulimit -n") as e:
            TokenShards(tmp_path / "s")
        assert not isinstance(e.value, DamagedShard)
    shards = TokenShards(tmp_path / "s")
    monkeypatch.setattr(shards_module, "open_token_cache", no_descriptors)
    with pytest.raises(UsageError, match=r"unit-00000.npy: too many open files .*ulimit -n"):
        shards[0:2]


def test_a_unit_damaged_after_opening_stops_its_first_read(tmp_path):
    shards = write_shards(tmp_path / "s", [[1, 2, 3], [4, 5, 6, 7]])
    with open(tmp_path / "s" / f"{unit_stem(1)}.npy", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    np.testing.assert_array_equal(shards[0:3], [1, 2, 3])
    with pytest.raises(UsageError, match=f"{unit_stem(1)}.npy is .* since this run opened it; run again"):
        shards[2:5]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_many_units_open_and_read_under_a_low_descriptor_limit(tmp_path, monkeypatch):
    """More units than the descriptor limit allows open at once: opening and reading them all still works."""
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(shards_module, "OPEN_UNITS", 2)
    pieces = [[i, i + 1, i + 2] for i in range(60)]
    write_shards(tmp_path / "s", pieces)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 12, hard))
    try:
        shards = TokenShards(tmp_path / "s")
        got = np.asarray(shards)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    np.testing.assert_array_equal(got, np.concatenate([np.asarray(p, np.uint16) for p in pieces]))
