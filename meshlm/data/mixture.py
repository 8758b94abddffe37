"""Mixtures: `--dataset=mix.toml` (or .yaml/.yml) trains on several datasets at set weights.

    [[sources]]
    dataset = "web.jsonl"      # anything --dataset takes; paths relative to this file
    weight = 3                 # a positive number; shares are weight / sum of weights
    text_field = "text"        # optional
    [[schedule]]               # optional: from this step on, these weights (sources not named keep theirs)
    from_step = 1000
    weights = { web = 1, code = 1 }   # keyed by source name: `name`, else the dataset's file stem

The rows of global batch s are a pure function of (seed, s): source i's rows are its items among the
first rows of a merged sequence in which its k-th item sits at (k + 1/2) / w_i (weights normalised),
so through any row count each source's count is within one row of its weighted share and every batch
holds exactly B rows. Source i's k-th row is read in that source's own shuffled order over its own
epochs. Nothing but the step needs saving to resume; the saved state names each source's row count.
"""

from __future__ import annotations

import importlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

import meshlm.data.tokenizer as tokenizers
from meshlm.data.chat import is_chat_dataset
from meshlm.data.corpus import is_synthetic
from meshlm.data.loader import DataLoader
from meshlm.data.loader import make_loader as make_dataset_loader
from meshlm.data.prefetch import DEFAULT_DEPTH, ReadsAhead
from meshlm.data.shuffle import Rows
from meshlm.errors import UsageError

MIXTURE_SUFFIXES = (".toml", ".yaml", ".yml")
_SOURCE_KEYS = {"dataset", "weight", "text_field", "name"}
_PHASE_KEYS = {"from_step", "weights"}


@dataclass(frozen=True)
class Source:
    name: str
    dataset: str
    weight: float
    text_field: str | None = None


@dataclass(frozen=True)
class Mixture:
    path: str
    sources: tuple[Source, ...]
    phases: tuple[tuple[int, tuple[float, ...]], ...]  # (from_step, normalised weights), the first from 0


def is_mixture(spec: str) -> bool:
    return Path(str(spec).strip()).suffix.lower() in MIXTURE_SUFFIXES


def read_mixture(path: str) -> Mixture:
    """The mixture file `path`, checked: each problem is one UsageError naming the file and the fix."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"mixture file {path} does not exist; give the path of a .toml or .yaml mixture")
    raw = _load(file)
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: a mixture is a table with a list of [[sources]]; see docs/data.md, Mixtures")
    _known(path, "the mixture", raw, {"sources", "schedule"})
    entries = raw.get("sources")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{path}: no sources; add [[sources]] entries with a dataset and a weight")
    sources = tuple(_source(path, file.parent, i, e) for i, e in enumerate(entries))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise UsageError(f"{path}: two sources are named alike ({', '.join(names)}); give each a distinct name")
    base = tuple(s.weight for s in sources)
    phases = [(0, _normalised(base))]
    for j, phase in enumerate(raw.get("schedule") or []):
        phases.append(_phase(path, j, phase, names, base, phases[-1][0]))
    return Mixture(str(path), sources, tuple(phases))


def _load(file: Path) -> object:
    text = file.read_text()
    if file.suffix.lower() == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"{file}: not valid TOML ({e}); fix the file") from None
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        raise UsageError(
            f"{file}: reading a YAML mixture needs PyYAML; pip install pyyaml, or write it as .toml"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(f"{file}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None


def _known(path: str, where: str, table, allowed: set[str]) -> None:
    if not isinstance(table, dict):
        raise UsageError(f"{path}: {where} must be a table of keys; see docs/data.md, Mixtures")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r} in {where}; use only {', '.join(sorted(allowed))}")


def _weight(path: str, where: str, value, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        kind = "a number >= 0" if allow_zero else "a positive number"
        raise UsageError(f"{path}: {where} has weight {value!r}; make it {kind}, e.g. weight = 1")
    return float(value)


def _source(path: str, folder: Path, i: int, entry) -> Source:
    where = f"source {i + 1}"
    _known(path, where, entry, _SOURCE_KEYS)
    dataset = entry.get("dataset")
    if not isinstance(dataset, str) or not dataset.strip():
        raise UsageError(f'{path}: {where} has no dataset; add dataset = "PATH" (relative to the file) or a spec')
    dataset = _resolve(path, folder, where, dataset.strip())
    weight = _weight(path, f"{where} ({dataset})", entry.get("weight"))
    name = str(entry.get("name") or Path(dataset.split(":")[-1]).stem or f"source{i + 1}")
    text_field = entry.get("text_field")
    return Source(name, dataset, weight, None if text_field is None else str(text_field))


def _resolve(path: str, folder: Path, where: str, dataset: str) -> str:
    """A path relative to the mixture file made absolute; other specs (stdlib, hf:NAME) as given."""
    if is_synthetic(dataset):
        raise UsageError(f"{path}: {where} is synthetic, which has no rows to mix; use a real dataset")
    if dataset.lower() == "stdlib" or dataset.startswith("hf:"):
        return dataset
    candidate = Path(dataset).expanduser()
    candidate = candidate if candidate.is_absolute() else folder / candidate
    if candidate.exists() or (any(c in dataset for c in "*?[") and any(candidate.parent.glob(candidate.name))):
        return str(candidate)
    raise UsageError(f"{path}: {where}'s dataset {dataset} is not found at {candidate}; fix the path")


def _phase(path: str, j: int, phase, names: list[str], base: tuple[float, ...], previous: int):
    where = f"schedule entry {j + 1}"
    _known(path, where, phase, _PHASE_KEYS)
    start = phase.get("from_step")
    if not isinstance(start, int) or isinstance(start, bool) or start <= previous:
        raise UsageError(f"{path}: {where} has from_step {start!r}; give steps that increase, after {previous}")
    weights = phase.get("weights")
    _known(path, f"{where}'s weights", weights, set(names))
    w = tuple(_weight(path, f"{where} ({n})", weights.get(n, b), allow_zero=True) for n, b in zip(names, base))
    if sum(w) <= 0:
        raise UsageError(f"{path}: {where} gives every source weight 0; give one a positive weight")
    return start, _normalised(w)


def _normalised(w) -> tuple[float, ...]:
    total = float(sum(w))
    return tuple(float(x) / total for x in w)


def first_rows(r: int, w: tuple[float, ...]) -> np.ndarray:
    """How many of the first `r` rows of the merged sequence each source holds (source i's k-th row at
    (k + 1/2) / w_i, ties to the lower source): counts that sum to r and never fall as r grows."""
    w_arr = np.asarray(w, dtype=np.float64)
    live = w_arr > 0
    counts = np.where(live, np.floor(r * w_arr + 0.5), 0).astype(np.int64)  # every row at or before r
    safe = np.where(live, w_arr, 1.0)
    while counts.sum() < r:  # add the earliest next rows
        nxt = np.where(live, (counts + 0.5) / safe, np.inf)
        counts[int(np.argmin(nxt))] += 1
    while counts.sum() > r:  # drop the latest rows taken (ties: the higher source is later)
        last = np.where(live & (counts > 0), (counts - 0.5) / safe, -np.inf)
        counts[len(last) - 1 - int(np.argmax(last[::-1]))] -= 1
    return counts


class MixtureLoader(ReadsAhead):
    """A `DataLoader`'s interface over a mixture: `batch(step)`, `next`, `state`/`restore`, held-out
    rows per source (`eval_split`), and `log_fields()` (tokens read from each source so far)."""

    synthetic, chat, chat_data, flags, tokens = False, None, None, None, None

    def __init__(self, mixture: Mixture, tokenizer, seq_len: int, global_batch_size: int, **options):
        self.mixture, self.spec, self.tokenizer, self.seq_len = mixture, mixture.path, tokenizer, seq_len
        self.global_batch_size = global_batch_size
        self.process_index, self.process_count = options.get("process_index", 0), options.get("process_count", 1)
        self.seed, self.step = options.get("seed", 0), int(options.get("start_step", 0))
        self.cache_dir, self.text_field = options.get("cache_dir"), options.get("text_field", "text")
        self.eval_split, self.prefetch = options.get("eval_split") or None, options.get("prefetch", DEFAULT_DEPTH)
        probe = DataLoader("synthetic", tokenizer, seq_len, global_batch_size, self.process_index, self.process_count)
        self.local_batch_size = probe.local_batch_size  # the checks of batch and process split, once
        self.sources = [self._open(s, options) for s in mixture.sources]
        self.names = [s.name for s in mixture.sources]
        self.num_rows = sum(s.num_rows or 0 for s in self.sources)
        self.steps_per_epoch: int | None = None  # each source has its own epochs
        self._phase_counts = self._phase_starts()
        self.held_out: Rows | None = None
        if self.eval_split:
            per_source = min(_held_count(s) for s in self.sources)
            self.held_out = Rows(per_source * len(self.sources), lambda q: np.asarray(q, dtype=np.int64))

    def _open(self, source: Source, options: dict) -> DataLoader:
        try:
            return DataLoader(
                source.dataset,
                self.tokenizer,
                self.seq_len,
                self.process_count,  # one row per process: the processes share the tokenizing
                self.process_index,
                self.process_count,
                seed=self.seed,
                shuffle=options.get("shuffle", True),
                cache_dir=self.cache_dir,
                text_field=source.text_field or self.text_field,
                eval_split=self.eval_split,
                prefetch=0,
            )
        except UsageError as e:
            raise UsageError(f"{self.spec}: source {source.name}: {e}") from None

    def _phase_starts(self) -> list[np.ndarray]:
        counts, B = [np.zeros(len(self.sources), np.int64)], self.global_batch_size
        for (start, w), (nxt, _) in zip(self.mixture.phases, self.mixture.phases[1:]):
            counts.append(counts[-1] + first_rows((nxt - start) * B, w))
        return counts

    def rows_through(self, step: int) -> np.ndarray:
        """Rows each source gave to global batches 0 .. step-1."""
        phases = self.mixture.phases
        p = max(i for i, (start, _) in enumerate(phases) if start <= step) if step > 0 else 0
        start, w = phases[p]
        return self._phase_counts[p] + first_rows((step - start) * self.global_batch_size, w)

    def composition(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's row ordinal) of each of global batch `step`'s rows, sources in turn."""
        before, after = self.rows_through(step), self.rows_through(step + 1)
        which = np.repeat(np.arange(len(self.sources)), after - before)
        ordinal = np.concatenate([np.arange(b, a) for b, a in zip(before, after)])
        return which, ordinal

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`."""
        which, ordinal = self.composition(step)
        first = self.process_index * self.local_batch_size
        mine = slice(first, first + self.local_batch_size)
        return self._read(which[mine], ordinal[mine], lambda src, k: src.rows_in_order(k))

    def read_held(self, items) -> dict[str, np.ndarray]:
        """Held-out items (item q: source q mod n, its held-out row q div n) as a batch."""
        n = len(self.sources)
        items = np.asarray(items, dtype=np.int64)
        return self._read(items % n, items // n, lambda src, k: src.order.held(k))

    def _read(self, which, index, row_ids) -> dict[str, np.ndarray]:
        parts = [self.sources[i].read(row_ids(self.sources[i], index[which == i])) for i in np.unique(which).tolist()]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def log_fields(self) -> dict[str, int]:
        """Tokens read from each source through the batches taken so far."""
        rows = self.rows_through(self.step)
        return {f"tokens_{name}": int(r) * self.seq_len for name, r in zip(self.names, rows)}

    def describe(self) -> list[str]:
        """What the run mixes: each source's tokens and the share of rows it is expected to give."""
        lines = []
        for s, src, w in zip(self.mixture.sources, self.sources, self.mixture.phases[0][1]):
            lines.append(
                f"mixture: {s.name} ({s.dataset}): {len(src.tokens)} tokens, {src.num_rows} rows, "
                f"expected share {w:.1%} of the rows{' at first' if len(self.mixture.phases) > 1 else ''}"
            )
        return lines

    @property
    def epoch(self) -> int:
        return 0

    def state(self) -> dict:
        """The step of the next batch, the seed, and each source's row and held-out row counts."""
        rows = {n: s.num_rows or 0 for n, s in zip(self.names, self.sources)}
        held = {n: _held_count(s) for n, s in zip(self.names, self.sources)}
        return {"step": self.step, "seed": self.seed, "rows": self.num_rows, "sources": rows, "held_out": held}

    def restore(self, state: dict) -> None:
        """Continue from a `state()`; a different seed or any source's rows is refused in one line."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise UsageError(f"the checkpoint's data seed is {state['seed']} but this run's is {self.seed}")
        for key in ("sources", "held_out"):
            mine = self.state()[key]
            if state.get(key, mine) != mine:
                raise UsageError(
                    f"the checkpoint's mixture has {key.replace('_', '-')} rows {state.get(key)} but {self.spec} "
                    f"gives {mine}; resume with the same mixture, --eval_split, tokenizer and seq_len"
                )
        self.close()
        self.step = int(state["step"])


def _held_count(loader: DataLoader) -> int:
    return len(loader.held_out) if loader.held_out is not None else 0


def load_tokenizer(spec: str | None, dataset: str, vocab_size: int, *, text_field: str = "text", **kwargs):
    """`meshlm.data.tokenizer.load_tokenizer`; without `spec`, a mixture's BPE is trained on its heaviest
    source (by the weights it starts with; the first of equals)."""
    if not spec and is_mixture(dataset):
        mixture = read_mixture(dataset)
        heaviest = max(range(len(mixture.sources)), key=lambda i: (mixture.phases[0][1][i], -i))
        source = mixture.sources[heaviest]
        dataset, text_field = source.dataset, source.text_field or text_field
    return tokenizers.load_tokenizer(spec, dataset, vocab_size, text_field=text_field, **kwargs)


def token_corpora(dataset: str, text_field: str = "text") -> list[tuple[str, str]]:
    """(dataset, text_field) of each corpus `dataset` reads as token shards: the dataset, or a mixture's
    sources; none for synthetic or chat data (tokenized in memory, `meshlm.data.chat`)."""
    pairs = (
        [(s.dataset, s.text_field or text_field) for s in read_mixture(dataset).sources]
        if is_mixture(dataset)
        else [(dataset, text_field)]
    )
    return [(d, f) for d, f in pairs if not is_synthetic(d) and not is_chat_dataset(d, f)]


def make_loader(dataset: str, tokenizer, seq_len: int, global_batch_size: int, *args, **kwargs):
    """`meshlm.data.loader.make_loader`, or a `MixtureLoader` when `dataset` is a mixture file."""
    if not is_mixture(dataset):
        return make_dataset_loader(dataset, tokenizer, seq_len, global_batch_size, *args, **kwargs)
    names = ("process_index", "process_count", "seed")
    kwargs.update(zip(names, args))
    for flag in ("chat_template", "loss_on", "long_conversations"):
        if kwargs.get(flag) not in (None, "all"):
            raise UsageError(f"--{flag} applies to chat data, not to a mixture {dataset}; leave it out")
    loader = MixtureLoader(read_mixture(dataset), tokenizer, seq_len, global_batch_size, **kwargs)
    if loader.process_index == 0:
        console = Console(stderr=True)
        for line in loader.describe():
            console.print(f"[meshlm] {line}", markup=False, highlight=False, soft_wrap=True)
    return loader
