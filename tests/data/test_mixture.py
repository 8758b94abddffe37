"""Mixtures: each source's share of the tokens follows its weight (and a schedule of weights), every
batch is whole, resume is exact, held-out rows per source, and each bad file is one line naming it."""

import json

import numpy as np
import pytest

from meshlm.data import load_tokenizer, make_eval_batches, make_loader
from meshlm.data.mixture import first_rows, read_mixture
from meshlm.errors import UsageError

SEQ, BATCH = 16, 8
WORDS = "the a of model mesh shard token data loader batch row epoch seed step def return".split()


def write_docs(path, n_docs, seed):
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=rng.integers(5, 60))) for _ in range(n_docs)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for i, (name, n) in enumerate([("web", 120), ("code", 60), ("books", 40)]):
        write_docs(root / f"{name}.jsonl", n, seed=i)
    return root


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(None, str(folder / "web.jsonl"), 300, cache_dir=folder / "cache")


def mix_file(folder, body, name="mix.toml"):
    path = folder / name
    path.write_text(body)
    return str(path)


THREE = """
[[sources]]
dataset = "web.jsonl"
weight = 5
[[sources]]
dataset = "code.jsonl"
weight = 3
[[sources]]
dataset = "books.jsonl"
weight = 2
"""


def loader_for(folder, tok, spec, **kw):
    return make_loader(spec, tok, SEQ, BATCH, cache_dir=folder / "cache", **kw)


def test_shares_follow_the_weights_over_1000_steps(folder, tok):
    loader = loader_for(folder, tok, mix_file(folder, THREE))
    loader.step = 1000
    tokens = loader.log_fields()
    total = sum(tokens.values())
    assert total == 1000 * BATCH * SEQ
    for name, weight in [("web", 0.5), ("code", 0.3), ("books", 0.2)]:
        assert abs(tokens[f"tokens_{name}"] / total - weight) < 0.01
    for step in (0, 1, 7, 999):  # every batch is whole, and its rows are the sources' rows
        batch = loader.batch(step)
        assert batch["inputs"].shape == (BATCH, SEQ)


def test_counts_never_fall_and_sum_to_the_rows():
    for w in [(0.5, 0.3, 0.2), (0.97, 0.02, 0.01), (0.0, 0.4, 0.6)]:
        previous = np.zeros(3, np.int64)
        for r in range(0, 400):
            counts = first_rows(r, w)
            assert counts.sum() == r and (counts >= previous).all()
            assert (np.abs(counts - np.asarray(w) * r) <= 1).all()
            previous = counts


def test_a_schedule_switches_the_weights(folder, tok):
    body = THREE + "[[schedule]]\nfrom_step = 100\nweights = { web = 0, code = 1 }\n"
    loader = loader_for(folder, tok, mix_file(folder, body, "sched.toml"))
    at_switch = loader.rows_through(100)
    later = loader.rows_through(300) - at_switch  # books keeps its weight 2: code 1/3, books 2/3
    assert later[0] == 0 and abs(later[1] / later.sum() - 1 / 3) < 0.01 and abs(later[2] / later.sum() - 2 / 3) < 0.01
    assert abs(at_switch[0] / at_switch.sum() - 0.5) < 0.01
    which, _ = loader.composition(150)
    assert 0 not in which.tolist() and len(which) == BATCH


def test_resume_at_step_n_equals_the_uninterrupted_run(folder, tok):
    spec = mix_file(folder, THREE)
    straight = loader_for(folder, tok, spec, seed=4)
    want = [next(straight) for _ in range(12)]
    first = loader_for(folder, tok, spec, seed=4)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    first.close()
    resumed = loader_for(folder, tok, spec, seed=4, process_index=1, process_count=2)
    resumed.restore(state)
    other_half = loader_for(folder, tok, spec, seed=4, process_index=0, process_count=2, prefetch=0)
    for step in range(5, 12):
        got = np.concatenate([other_half.batch(step)["inputs"], next(resumed)["inputs"]])
        np.testing.assert_array_equal(got, want[step]["inputs"])
    straight.close(), resumed.close()
    with pytest.raises(UsageError, match="seed"):
        loader_for(folder, tok, spec, seed=5).restore(state)
    changed = mix_file(folder, THREE.replace('"books.jsonl"', '"web.jsonl"\nname = "books"'), "other.toml")
    with pytest.raises(UsageError, match="same mixture"):
        loader_for(folder, tok, changed, seed=4).restore(state)


def test_held_out_rows_per_source_never_train(folder, tok):
    loader = loader_for(folder, tok, mix_file(folder, THREE), eval_split=0.1)
    held = {i: set(src.order.held(np.arange(len(src.held_out))).tolist()) for i, src in enumerate(loader.sources)}
    for step in range(40):
        which, ordinal = loader.composition(step)
        for i in range(3):
            rows = loader.sources[i].rows_in_order(ordinal[which == i])
            assert not held[i] & set(rows.tolist())
    evals = make_eval_batches(loader, None, 2)
    assert len(evals.batches()) == 2 and evals.batches()[0]["inputs"].shape == (BATCH, SEQ)
    assert len(loader.held_out) == 3 * min(len(s.held_out) for s in loader.sources)


@pytest.mark.parametrize(
    "body, message",
    [
        ('[[sources]]\ndataset = "missing.jsonl"\nweight = 1\n', "missing.jsonl is not found"),
        ('[[sources]]\ndataset = "web.jsonl"\nweight = 0\n', "make it a positive number"),
        ('[[sources]]\ndataset = "web.jsonl"\nweight = -2\n', "make it a positive number"),
        ('[[sources]]\ndataset = "web.jsonl"\nweight = "heavy"\n', "make it a positive number"),
        ('[[sources]]\ndataset = "web.jsonl"\nweight = 1\nshare = 2\n', "unknown key 'share'"),
        ('mix = 1\n[[sources]]\ndataset = "web.jsonl"\nweight = 1\n', "unknown key 'mix'"),
        ("", "no sources"),
        ('[[sources]]\ndataset = "empty.jsonl"\nweight = 1\n', "source empty"),
        ('[[sources]]\ndataset = "synthetic"\nweight = 1\n', "synthetic"),
    ],
)
def test_bad_input_is_one_line_naming_the_file(folder, tok, body, message):
    (folder / "empty.jsonl").write_text("")
    spec = mix_file(folder, body, "bad.toml")
    with pytest.raises(UsageError, match=message) as err:
        loader_for(folder, tok, spec)
    assert spec in str(err.value) and "\n" not in str(err.value)


def test_yaml_reads_like_toml(folder):
    pytest.importorskip("yaml")
    spec = mix_file(folder, "sources:\n  - dataset: web.jsonl\n    weight: 2\n    name: w\n", "mix.yaml")
    mix = read_mixture(spec)
    assert mix.sources[0].name == "w" and mix.sources[0].dataset == str(folder / "web.jsonl")


def test_a_missing_mixture_file_names_it(folder):
    with pytest.raises(UsageError, match="does not exist"):
        read_mixture(str(folder / "nope.toml"))


def test_yaml_without_pyyaml_says_how_to_get_it(folder, monkeypatch):
    import meshlm.data.mixture as mixture

    real = mixture.importlib.import_module

    def no_yaml(name, *a):
        if name == "yaml":
            raise ImportError("No module named 'yaml'")
        return real(name, *a)

    monkeypatch.setattr(mixture.importlib, "import_module", no_yaml)
    spec = mix_file(folder, "sources: []\n", "plain.yml")
    with pytest.raises(UsageError, match="pip install pyyaml, or write it as .toml") as err:
        read_mixture(spec)
    assert spec in str(err.value)


def test_a_mixture_without_a_tokenizer_trains_it_on_its_heaviest_source(folder, tok):
    """The default BPE of a mixture is the one its heaviest source (web, weight 5) would train."""
    spec = mix_file(folder, THREE, name="heaviest.toml")
    got = load_tokenizer(None, spec, 300, cache_dir=folder / "cache")
    assert got.fingerprint == tok.fingerprint
    lighter = load_tokenizer(None, str(folder / "books.jsonl"), 300, cache_dir=folder / "cache")
    assert lighter.fingerprint != tok.fingerprint
