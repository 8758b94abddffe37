"""--sharding_rules: [logical] overrides, [[rules]] on parameter paths, [[layers]] ranges with their
boundary visible in explain, and one-line errors (exit 2) for every rule that cannot be honoured."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.explain.analysis import boundaries, collectives
from meshlm.models.placement import place
from meshlm.strategy import choose
from tests.support.cli import meshlm
from tests.support.training import CFG, POLICY, B, T, mesh_for
from tests.support.training import run_strategy as run

GROUPS = """
[[layers]]            # layer 0 data parallel, layer 1 (the rest) Megatron tensor parallel
range = [0, 0]
strategy = "dp"
"""


def write(tmp_path, text, name="rules.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_logical_and_path_rules(tmp_path):
    f = write(
        tmp_path,
        """
[logical]
mlp = ["tp"]
vocab = []
[[rules]]
pattern = "mlp/(gate|up)$"
spec = ["", "fsdp", "tp"]
[[rules]]
pattern = "attn/w[qkv]"
spec = ["fsdp", "", ""]      # one layer's dims: the stacked layers axis follows the table
[[rules]]
pattern = "mlp/"                 # the rest of the MLP: first match wins, gate and up are taken
spec = ["", "tp", ""]
""",
    )
    strategy, rules = choose("default", None, f)
    placement = place(CFG, mesh_for("1,2,4,1"), strategy, rules, policy=POLICY)
    layers = placement.specs["layers"]
    assert layers["mlp"]["gate"] == layers["mlp"]["up"] == P(None, "fsdp", "tp")
    assert layers["attn"]["wq"] == P(None, "fsdp", None, None)
    assert layers["mlp"]["down"] == P(None, "tp", None)
    assert placement.specs["embed"] == P(None, "fsdp")  # [logical] vocab = []: the vocab dim stays whole
    assert placement.sources["layers/mlp/gate"] == "rule #1 'mlp/(gate|up)$'"
    assert placement.sources["layers/mlp/down"] == "rule #3 'mlp/'"
    assert placement.sources["embed"].startswith("table default")
    assert placement.opt_specs["layers"]["mlp"]["gate"] == P(None, "fsdp", "tp")  # rules set state layouts too


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    f = write(tmp_path_factory.mktemp("rules"), GROUPS)
    return run("1,1,8,1", "megatron", rules_file=f), f


def test_layer_ranges_get_their_strategy(grouped):
    placement = grouped[0]["placement"]
    assert [(g.key, g.strategy.name) for g in placement.groups] == [("0-0", "dp"), ("1-1", "megatron")]
    dp, tp = placement.specs["layers"]["0-0"], placement.specs["layers"]["1-1"]
    assert dp["mlp"]["gate"] == P(None, None, None) and dp["attn"]["wq"] == P(None, None, None, None)
    assert tp["mlp"]["gate"] == P(None, None, "tp") and tp["attn"]["wq"] == P(None, None, "tp", None)
    assert placement.sources["layers/0-0/mlp/gate"] == "table dp (layers 0-0)"
    assert grouped[0]["state"].params["layers"]["1-1"]["mlp"]["down"].sharding.spec == P(None, "tp", None)


def test_layer_ranges_train_like_one_device(grouped, reference):
    np.testing.assert_allclose(grouped[0]["losses"], reference, rtol=1e-5)


def test_boundary_costs_one_all_gather_of_the_residual(grouped):
    placement = grouped[0]["placement"]
    (b,) = boundaries(placement, B, T)
    assert (b["spec_before"], b["spec_after"]) == (P("tp", None, None), P(None, None, None))
    residual = B * T * CFG.d_model * 4
    assert [(c.kind, c.axes, c.payload_bytes) for c in b["forward"]] == [("all-gather", ("tp",), residual)]
    assert b["backward"] == []  # back to the batch split: each device keeps its own rows, no traffic
    # and the compiled step has it, at the boundary
    at = [c for c in collectives(grouped[0]["step"].as_text(), placement) if "boundary 0-0>1-1" in c.where]
    assert any(c.kind == "all-gather" and c.axes == ("tp",) and c.payload_bytes == residual for c in at), at


def test_explain_shows_the_boundary_and_every_table(grouped, capsys, tmp_path):
    from meshlm.cli import main

    png = tmp_path / "gate.png"
    code = main(
        [
            "explain",
            "--devices=8",
            "--mesh_dim=1,1,8,1",
            "--model=test",
            "--model.n_kv_heads=8",
            f"--png={png}",
            "--strategy=megatron",
            f"--sharding_rules={grouped[1]}",
            f"--batch_size={B}",
            f"--seq_len={T}",
            "--tensor=layers/1-1/mlp/gate",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "boundary layers 0-0 (dp) -> layers 1-1 (megatron)" in out
    assert "forward: all-gather over tp 65,536 B" in out
    assert "forward of boundary 0-0>1-1" in out  # the same collective, found in the step's HLO
    assert "table dp (layers 0-0)" in out and "table megatron (layers 1-1)" in out
    assert "devs 0,1,2,3,4,5,6,7" not in out.split("layers/1-1/mlp/gate (1, 64, 128)")[-1]  # split 8 ways
    assert "dev 7" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TRAIN = ["train", "--devices=8", "--model=test", "--dataset=synthetic", "--steps=1", "--batch_size=8", "--seq_len=32"]
BAD = [
    ("[[rules]]\npattern = 'mlp/nothing'\nspec = ['', 'tp', '']\n", [], "rule #1 'mlp/nothing' matches no parameter"),
    (
        "[[rules]]\npattern = 'mlp/gate'\nspec = ['', '', 'tp']\n[[rules]]\npattern = 'mlp/(gate)'\nspec = ['', 'fsdp', '']\n",
        [],
        "rule #2 'mlp/(gate)' never applies: rule #1 'mlp/gate' takes parameter layers/mlp/gate first",
    ),
    (
        "[[rules]]\npattern = 'mlp/gate'\nspec = ['tp', '', '']\n",
        ["--mesh_dim=1,1,8,1"],
        "rule #1 'mlp/gate' gives parameter layers/mlp/gate (2, 64, 128) params spec P('tp', None, None): dimension 0 of size 2 is not divisible by tp = 8",
    ),
    ("[[rules]]\npattern = 'mlp/gate'\nspec = ['tp', 'tp', '']\n", [], "puts mesh axis 'tp' on two dimensions"),
    (
        "[[rules]]\npatern = 'mlp/gate'\nspec = ['', 'tp', '']\n",
        [],
        "rule #1: unknown key 'patern'; give exactly pattern =",
    ),
    ("[[rules]]\npattern = 'mlp/gate'\nspec = ['', 'model', '']\n", [], "unknown mesh axis 'model'"),
    (
        "[[layers]]\nrange = [0, 1]\nstrategy = 'dp'\n[[layers]]\nrange = [1, 1]\nstrategy = 'megatron'\n",
        [],
        "[[layers]] #1 and #2 both cover layer 1",
    ),
    ("[[layers]]\nrange = [0, 5]\nstrategy = 'dp'\n", [], "goes past the model's last layer 1"),
    (
        "[[layers]]\nrange = [0, 0]\nstrategy = 'zero9'\n",
        [],
        "[[layers]] #1: strategy = 'zero9': unknown preset; choose",
    ),
    (
        "[[layers]]\nrange = [0, 0]\nstrategy = 'dpp'\n",
        [],
        "[[layers]] #1: strategy = 'dpp': unknown preset; did you mean dp?",
    ),
    ("[logical]\nhidden = ['tp']\n", [], "unknown logical axis 'hidden'"),
    ("[logical\nmlp = 1\n", [], "not valid TOML"),
    ("", ["--zero_stage=5"], "--zero_stage=5: choose 0"),
    ("", ["--strategy=zero"], "--strategy=zero: unknown preset; choose one of default, dp, fsdp"),
    ("", ["--strategy=megatorn"], "--strategy=megatorn: unknown preset; did you mean megatron? choose one of"),
    (
        "",
        ["--strategy=dp", "--mesh_dim=1,1,8,1", "--batch_size=4"],
        "splits the batch over tp = 8 devices but a step has 4 rows",
    ),
]


@pytest.mark.parametrize("text,flags,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_each_bad_rule_is_one_line_exit_2(tmp_path, capsys, text, flags, message):
    from meshlm.cli import main

    args = TRAIN + flags + ([f"--sharding_rules={write(tmp_path, text)}"] if text else [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_bad_rule_from_a_real_process(tmp_path):
    f = write(tmp_path, BAD[0][0])
    result = meshlm(*TRAIN, f"--sharding_rules={f}", timeout=120)
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert BAD[0][2] in err and len(err.splitlines()) == 1, err
