"""--mesh_dim / --mp_mesh_dim parsing and the checks that run before anything compiles."""

import pytest

from meshlm.errors import UsageError
from meshlm.mesh import (
    MeshShape,
    all_mesh_shapes,
    parse_mesh_dim,
    parse_mp_mesh_dim,
    resolve_mesh_shape,
    validate_mesh_shape,
)

GOOD = [
    ("1,64,4,1", 256, (1, 64, 4, 1)),
    ("1,1,4,64", 256, (1, 1, 4, 64)),
    ("1,-1,4,1", 256, (1, 64, 4, 1)),
    ("-1,1,1,1", 8, (8, 1, 1, 1)),
    ("2,2,2,1", 8, (2, 2, 2, 1)),
    (" 1, 8 ,1,1 ", 8, (1, 8, 1, 1)),
    ("fsdp:-1,tp:2", 8, (1, 4, 2, 1)),
    ("sp:8", 8, (1, 1, 1, 8)),
    ("tp:2,dp:2,fsdp:2", 8, (2, 2, 2, 1)),
    ("1,1,1,1", 1, (1, 1, 1, 1)),
]


@pytest.mark.parametrize("text,n,expected", GOOD)
def test_parse_good(text, n, expected):
    assert parse_mesh_dim(text, n).sizes == expected


def test_pipeline_stages_come_out_before_the_minus_one_is_filled():
    shape = parse_mesh_dim("1,-1,2,1", 8, pp=2)
    assert (shape.sizes, shape.pp, shape.n_devices) == ((1, 2, 2, 1), 2, 8)
    assert shape.flags == "--mesh_dim=1,2,2,1 --pp=2"
    assert shape.mesh_axes == (("pp", "dp", "fsdp", "tp", "sp"), (2, 1, 2, 2, 1))
    assert parse_mesh_dim("pp:4,fsdp:-1", 8) == MeshShape(fsdp=2, pp=4)
    assert parse_mesh_dim("1,8,1,1", 8).mesh_axes == (("dp", "fsdp", "tp", "sp"), (1, 8, 1, 1))


BAD = [
    ("1,4,1,1", 8, "multiply to 4 but there are 8 devices"),
    ("-1,-1,2,1", 8, "only one axis may be -1"),
    ("1,0,8,1", 8, "0 is not a valid axis size"),
    ("1,-2,8,1", 8, "-2 is not a valid axis size"),
    ("1,2.5,4,1", 8, "'2.5' is not an integer"),
    ("1,x,4,1", 8, "'x' is not an integer"),
    ("1,8,1", 8, "expected 4 sizes"),
    ("1,8,1,1,1", 8, "expected 4 sizes"),
    ("", 8, "give four comma-separated sizes"),
    ("1,,1,1", 8, "give four comma-separated sizes"),
    ("pp:-1,fsdp:4", 8, "give pp a size"),
    ("pp:3,fsdp:-1", 8, "--pp=3 does not divide the 8 devices"),
    ("pp:2,fsdp:8", 8, "multiply to 8 but there are 4 devices per stage"),
    ("model:8", 8, "unknown axis 'model'"),
    ("tp:2,tp:4", 8, "given twice"),
    ("tp:2,4", 8, "mix of named and positional"),
    ("1,3,-1,1", 8, "does not divide the 8 devices"),
]


@pytest.mark.parametrize("text,n,message", BAD)
def test_parse_bad(text, n, message):
    with pytest.raises(UsageError, match=None) as err:
        parse_mesh_dim(text, n)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_mp_mesh_dim_infers_data_axis():
    assert parse_mp_mesh_dim("2,1", 8).sizes == (4, 1, 2, 1)
    assert parse_mp_mesh_dim("2,1", 8, fsdp=True).sizes == (1, 4, 2, 1)
    assert parse_mp_mesh_dim("-1,1", 8).sizes == (1, 1, 8, 1)  # -1: the whole device count
    assert parse_mp_mesh_dim("1,-1", 8, fsdp=True).sizes == (1, 1, 1, 8)
    with pytest.raises(UsageError, match="does not divide"):
        parse_mp_mesh_dim("3,1", 8)
    with pytest.raises(UsageError, match="expected 2"):
        parse_mp_mesh_dim("1,1,1", 8)
    with pytest.raises(UsageError, match="only one axis"):
        parse_mp_mesh_dim("-1,-1", 8)


def test_resolve_defaults_and_conflicts():
    assert resolve_mesh_shape(None, None, False, 8).sizes == (1, 8, 1, 1)
    assert str(resolve_mesh_shape(None, "2,1", True, 8)) == "1,4,2,1"
    with pytest.raises(UsageError, match="both given"):
        resolve_mesh_shape("1,8,1,1", "2,1", False, 8)
    with pytest.raises(UsageError, match="--fsdp goes with --mp_mesh_dim"):
        resolve_mesh_shape("1,8,1,1", None, True, 8)


JOB = dict(batch_size=8, seq_len=256, n_heads=8, n_kv_heads=8, mlp_dim=128, vocab_size=256)


def test_validate_accepts_fitting_meshes():
    for shape in [MeshShape(1, 8, 1, 1), MeshShape(2, 2, 2, 1), MeshShape(1, 1, 1, 8), MeshShape(1, 1, 8, 1)]:
        validate_mesh_shape(shape, **JOB)


@pytest.mark.parametrize(
    "shape,job,message",
    [
        (MeshShape(1, 8, 1, 1), dict(batch_size=1), "global batch size 1 is smaller than dp×fsdp = 8"),
        (MeshShape(2, 2, 2, 1), dict(batch_size=6), "global batch size 6 is not divisible by dp×fsdp = 4"),
        (MeshShape(1, 1, 1, 8), dict(seq_len=100), "seq_len 100 is not divisible by 2×sp = 16"),
        (MeshShape(1, 1, 8, 1), dict(n_heads=4, n_kv_heads=4), "n_heads = 4 is not divisible by tp = 8"),
        (MeshShape(1, 1, 8, 1), dict(mlp_dim=100), "mlp_dim = 100 is not divisible by tp = 8"),
        (MeshShape(1, 1, 8, 1), dict(vocab_size=100), "vocab_size = 100 is not divisible by tp = 8"),
    ],
)
def test_validate_errors(shape, job, message):
    with pytest.raises(UsageError) as err:
        validate_mesh_shape(shape, **{**JOB, **job})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_batch_error_lists_meshes_that_work():
    """Batch 1 on 8 devices: LWM users got an opaque shard_map error; we name the meshes that fit."""
    with pytest.raises(UsageError) as err:
        validate_mesh_shape(MeshShape(1, 8, 1, 1), **{**JOB, "batch_size": 1})
    text = str(err.value)
    assert "--mesh_dim=1,1,8,1" in text and "--mesh_dim=1,1,1,8" in text
    suggested = [s.split("=")[1] for s in text.split() if s.startswith("--mesh_dim=")][1:]
    for dims in suggested:
        validate_mesh_shape(parse_mesh_dim(dims.rstrip(","), 8), **{**JOB, "batch_size": 1})


def test_all_mesh_shapes_cover_every_factorisation():
    shapes = all_mesh_shapes(8)
    assert len(shapes) == len(set(shapes)) == 20  # compositions of 2^3 into 4 ordered factors: C(6,3)
    assert all(s.n_devices == 8 for s in shapes)
