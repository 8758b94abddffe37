"""Tokenizing a corpus of any size in parallel into token shards (`meshlm.data.shards`).

    shards = prepare_tokens("data/", tokenizer, workers=16)   # a TokenShards: len, slices, ensure_intact

The corpus's units (`Corpus.units`) are encoded by worker processes started with `spawn` (the caller may
have JAX running: nothing is forked), each taking whole units and writing them a chunk of documents at a
time, so memory stays bounded. A unit is written under a temporary name (host, process and a random part)
and renamed when complete, then its record (`unit-NNNNN.json`) marks it done: an interrupted run keeps its
finished units, and a start removes only temp files no one has written to for STALE_TMP_AGE. With several
processes, process p encodes the units u with u % process_count == p, waits for the others' units, and
process 0 writes the manifest. Tokenizers other than a meshlm `Tokenizer` are run in this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import json
import multiprocessing
import os
import queue
import re
import secrets
import socket
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from meshlm.data.corpus import DEFAULT_UNIT_BYTES, atomic_write, cache_root, open_corpus
from meshlm.data.shards import FORMAT, MANIFEST, DamagedShard, GrowingNpy, TokenShards, unit_stem
from meshlm.data.token_cache import DamagedCache
from meshlm.data.tokenizer import Tokenizer
from meshlm.data.unit_progress import UnitProgress
from meshlm.errors import UsageError

UNIT_BYTES = DEFAULT_UNIT_BYTES  # input bytes per unit at most: the work one worker takes at a time
MIN_UNIT_BYTES = 1 << 20  # ... and at least, unless the corpus is smaller
TARGET_UNITS = 64  # units a corpus is cut into when that keeps them between those sizes
CHUNK_CHARS = 1 << 20  # characters of text encoded per batch call: bounds a worker's memory
IN_PROCESS_BYTES = 8 << 20  # less input than this to encode is encoded here: starting workers would cost more
PEER_TIMEOUT = 600.0  # seconds without progress from another process (a unit, or a temp file growing) before giving up
STALE_TMP_AGE = 600.0  # seconds since a temp file last grew before a start takes its writer for dead
_POLL = 0.5
UNITS_RECORD = "units.json"  # in a shard folder: the unit size its preparation uses


def unit_source(unit) -> str:
    """What the summary counts a unit under: its file when all its input is one file, else its label."""
    paths = {str(getattr(p, "path", "")) for p in getattr(unit, "pieces", ())}
    return paths.pop() if len(paths) == 1 and "" not in paths else unit.label


def unit_size(corpus) -> int:
    """Input bytes per unit: the corpus's size over TARGET_UNITS, within [MIN_UNIT_BYTES, UNIT_BYTES], so that
    even a small corpus keeps many workers busy. Every process of a run computes the same."""
    total = sum(u.nbytes for u in corpus.units(UNIT_BYTES))
    return int(min(UNIT_BYTES, max(MIN_UNIT_BYTES, total // TARGET_UNITS)))


def shard_folder(corpus, tokenizer, cache_dir=None) -> Path:
    """Where `corpus` tokenized by `tokenizer` is prepared: keyed by format, corpus and fingerprints (not by the
    unit size, which the folder's first preparation fixes: `settled_unit_bytes`)."""
    key = f"{FORMAT}|{corpus.spec}|{corpus.fingerprint}|{tokenizer.fingerprint}"
    slug = re.sub(r"[^A-Za-z0-9]+", "_", corpus.spec).strip("_")[-40:] or "corpus"
    return cache_root(cache_dir) / "shards" / f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def settled_unit_bytes(folder: Path, wanted: int) -> int:
    """The unit size of the preparation in `folder`: the first one asked for there (recorded in `units.json`),
    so that a run resumed, or read by `meshlm train`, with another size reuses the finished units."""
    record = folder / UNITS_RECORD
    if not record.is_file():
        tmp = folder / f".{UNITS_RECORD}.{_writer_tag()}"
        try:
            tmp.write_text(json.dumps({"unit_bytes": int(wanted)}) + "\n")
            os.link(tmp, record)  # complete before it appears; the first process to link it decides
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    for _ in range(100):  # another process may be writing it right now
        try:
            return int(json.loads(record.read_text())["unit_bytes"])
        except (ValueError, KeyError):
            time.sleep(0.05)
    raise UsageError(f"{record} cannot be read; delete {folder} and run again")


def _writer_tag() -> str:
    """A temp file's suffix, unique to this writer among processes and hosts sharing the folder."""
    host = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname()) or "host"
    return f"{host}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _remove_stale_temps(folder: Path, indices, max_age: float) -> None:
    """Remove the temp files of units `indices` not written to for `max_age` seconds (their writer stopped);
    a live writer's, of this host or another, are left to it."""
    now = time.time()
    for i in indices:
        for tmp in folder.glob(f".{unit_stem(i)}.*.tmp"):
            try:
                if now - tmp.stat().st_mtime > max_age:
                    tmp.unlink(missing_ok=True)
            except FileNotFoundError:
                pass


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ------------------------------------------------------------------------------ encoding one unit


def _text_chunks(documents, max_chars: int):
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if chars >= max_chars:
            yield chunk, chars
            chunk, chars = [], 0
    if chunk:
        yield chunk, chars


def _flatten(batch: list[list[int]], eos_id: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(each document's ids followed by eos, as one array; the length of each document with its eos)."""
    lengths = np.fromiter(map(len, batch), np.int64, len(batch))
    flat = np.array(list(itertools.chain.from_iterable(batch)), dtype)
    return np.insert(flat, np.cumsum(lengths), np.asarray(eos_id, dtype)), lengths + 1


def write_unit(unit, folder: Path, index: int, encode, eos_id: int, dtype, report, process_index: int = 0) -> dict:
    """Encode `unit` into `folder` (files renamed into place when complete, then its record); `encode(texts)`
    gives each text's ids, `report(documents, tokens, bytes)` hears of every chunk. Returns the record."""
    stem, tag = unit_stem(index), _writer_tag()
    tmp_tokens, tmp_ends = folder / f".{stem}.npy.{tag}", folder / f".{stem}.docs.npy.{tag}"
    tokens, ends = GrowingNpy(tmp_tokens, dtype), GrowingNpy(tmp_ends, np.int64)
    n_docs, reported = 0, 0
    try:
        for texts, chars in _text_chunks(unit.documents(), CHUNK_CHARS):
            ids, lengths = _flatten(encode(texts), eos_id, dtype)
            ends.append(tokens.length + np.cumsum(lengths))
            tokens.append(ids)
            n_docs += len(texts)
            step = max(0, min(chars, unit.nbytes - reported))
            reported += step
            report(len(texts), len(ids), step)
        tokens.close()
        ends.close()
        report(0, 0, max(0, unit.nbytes - reported))
        try:
            os.replace(tmp_ends, folder / f"{stem}.docs.npy")
            os.replace(tmp_tokens, folder / f"{stem}.npy")
        except FileNotFoundError:
            if _done(folder, index):  # another preparation of the folder finished it meanwhile
                return json.loads((folder / f"{stem}.json").read_text())
            raise UsageError(
                f"the temporary files of {stem} in {folder} were removed while this process wrote them; run again"
            ) from None
    finally:
        for tmp in (tmp_tokens, tmp_ends):
            tmp.unlink(missing_ok=True)
    record = {
        "stem": stem,
        "label": unit.label,
        "source": unit_source(unit),
        "documents": n_docs,
        "tokens": tokens.length,
        "bytes": unit.nbytes,
        "process": process_index,
    }
    atomic_write(folder / f"{stem}.json", lambda tmp: tmp.write_text(json.dumps(record) + "\n"))
    return record


_WORKER: dict = {}  # in a worker process: its tokenizer and the queue it reports progress on


def _start_worker(tokenizer: Tokenizer, progress, threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # before the tokenizer's thread pool starts
    _WORKER.update(tokenizer=tokenizer, progress=progress)


def _worker_unit(unit, folder: Path, index: int, eos_id: int, dtype: str, process_index: int) -> dict:
    tokenizer, progress = _WORKER["tokenizer"], _WORKER["progress"]
    # The tokenizer's own copy that encodes special-token text as text (`encode_batch(special_as_text=True)`),
    # called without character offsets, which nothing here reads: a sixth less work.
    as_text = tokenizer._plain_text_tokenizer()

    def encode(texts):
        return [e.ids for e in as_text.encode_batch_fast(texts, add_special_tokens=False)]

    return write_unit(unit, folder, index, encode, eos_id, dtype, lambda *n: progress.put(n), process_index)


# ------------------------------------------------------------------------------ the whole corpus


def _done(folder: Path, index: int) -> bool:
    return (folder / f"{unit_stem(index)}.json").is_file()


def _encode_units(todo, units, folder, tokenizer, workers, process_index, progress: UnitProgress) -> None:
    """Encode units `todo` (indices into `units`): in worker processes for a meshlm Tokenizer, else (and for
    one worker or less than `IN_PROCESS_BYTES` of input) here."""
    dtype = token_dtype(tokenizer.vocab_size).str
    small = sum(units[i].nbytes for i in todo) < IN_PROCESS_BYTES
    if not isinstance(tokenizer, Tokenizer) or workers == 1 or small:

        def encode(texts):
            if isinstance(tokenizer, Tokenizer):
                return tokenizer.encode_batch(texts, special_as_text=True)
            return [tokenizer.encode(t) for t in texts]

        for i in todo:
            write_unit(units[i], folder, i, encode, tokenizer.eos_id, dtype, progress.advance, process_index)
        return
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // workers)
    with cf.ProcessPoolExecutor(
        workers, ctx, initializer=_start_worker, initargs=(tokenizer, reports, threads)
    ) as pool:
        futures = [pool.submit(_worker_unit, units[i], folder, i, tokenizer.eos_id, dtype, process_index) for i in todo]
        pending = set(futures)
        try:
            while pending:
                _drain(reports, progress, timeout=0.1)
                finished = {f for f in pending if f.done()}
                for f in finished:
                    f.result()  # a worker's error stops the run here
                pending -= finished
        except BaseException:
            for f in pending:
                f.cancel()  # units not started yet; those under way finish and are kept
            raise
        _drain(reports, progress, timeout=0.0)


def _drain(reports, progress: UnitProgress, timeout: float) -> None:
    """Pass the workers' reports so far to the progress bar (waiting up to `timeout` for the first)."""
    try:
        first = reports.get(timeout=timeout) if timeout else reports.get_nowait()
        progress.advance(*first)
        while True:
            progress.advance(*reports.get_nowait())
    except queue.Empty:
        pass


def _temp_growth(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime) of each unit temp file in `folder`: what a unit being written changes."""
    out = {}
    for tmp in folder.glob(".unit-*.tmp"):
        try:
            st = tmp.stat()
        except FileNotFoundError:
            continue
        out[tmp.name] = (st.st_size, st.st_mtime_ns)
    return out


def _wait_for(paths: list[Path], what: str, timeout: float) -> None:
    """Poll until every path exists; UsageError when for `timeout` seconds none appears and no unit temp file
    in their folder grows (a unit may take longer than the timeout to write)."""
    folder = paths[0].parent
    missing, last_change, temps = [p for p in paths if not p.exists()], time.monotonic(), _temp_growth(folder)
    while missing:
        time.sleep(_POLL)
        still, now_temps = [p for p in missing if not p.exists()], _temp_growth(folder)
        if len(still) < len(missing) or any(temps.get(name) != seen for name, seen in now_temps.items()):
            last_change = time.monotonic()
        missing, temps = still, now_temps
        if missing and time.monotonic() - last_change > timeout:
            raise UsageError(
                f"waited {timeout:.0f} s for {what} ({len(missing)} missing, first {missing[0]}); start every "
                "process with the same --dataset, --tokenizer and --cache_dir, and --num_processes"
            )


def _write_manifest(folder: Path, corpus, tokenizer, n_units: int) -> None:
    records = [json.loads((folder / f"{unit_stem(i)}.json").read_text()) for i in range(n_units)]
    manifest = {
        "format": FORMAT,
        "corpus": corpus.spec,
        "corpus_fingerprint": corpus.fingerprint,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "dtype": token_dtype(tokenizer.vocab_size).str,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "units": records,
    }
    atomic_write(folder / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1) + "\n"))


def _open_or_forget(folder: Path, console: Console) -> TokenShards | None:
    """The prepared shards, or None (the manifest and a damaged unit's record removed, to be prepared again)."""
    if not (folder / MANIFEST).is_file():
        return None
    try:
        return TokenShards(folder)
    except DamagedCache as e:
        console.print(f"[meshlm] the token shards: {e}; preparing again", markup=False, highlight=False)
        if isinstance(e, DamagedShard):
            (folder / f"{e.stem}.json").unlink(missing_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)
        return None


def prepare_tokens(
    spec: str,
    tokenizer,
    *,
    cache_dir=None,
    text_field: str = "text",
    workers: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    console: Console | None = None,
    unit_bytes: int | None = None,
    peer_timeout: float = PEER_TIMEOUT,
) -> TokenShards:
    """The corpus `spec` tokenized into shards (module docstring), prepared now or found prepared; each
    document's ids followed by `tokenizer.eos_id`, in corpus order. `unit_bytes`: input bytes per unit
    (default `unit_size(corpus)`)."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise UsageError(f"process {process_index} is not in 0 .. {process_count - 1}; pass --process_id below it")
    console = console or Console(stderr=True)
    corpus = open_corpus(spec, text_field)
    folder = shard_folder(corpus, tokenizer, cache_dir)
    shards = _open_or_forget(folder, console)
    if shards is not None:
        return shards
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot write token shards to {folder} ({e}); set --cache_dir or MESHLM_CACHE to a writable folder"
        ) from e
    units = corpus.units(settled_unit_bytes(folder, unit_bytes or unit_size(corpus)))
    mine = [i for i in range(len(units)) if i % process_count == process_index]
    todo = [i for i in mine if not _done(folder, i)]
    _remove_stale_temps(folder, todo, STALE_TMP_AGE)  # what an interrupted run left half-written
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    with UnitProgress(console, corpus.spec, sum(units[i].nbytes for i in todo)) as progress:
        if todo:
            _encode_units(todo, units, folder, tokenizer, n_workers, process_index, progress)
    if open_corpus(spec, text_field).fingerprint != corpus.fingerprint:
        raise UsageError(f"the corpus {corpus.spec} changed while it was being tokenized; run again")
    stems = [folder / f"{unit_stem(i)}.json" for i in range(len(units))]
    _wait_for(stems, f"the other processes' units of {corpus.spec}", peer_timeout)
    if process_index == 0:
        _write_manifest(folder, corpus, tokenizer, len(units))
    else:
        _wait_for([folder / MANIFEST], f"process 0's manifest of {corpus.spec}", peer_timeout)
    shards = TokenShards(folder)
    UnitProgress.summary(console, shards, done=len(todo))
    return shards


__all__ = [
    "CHUNK_CHARS",
    "MIN_UNIT_BYTES",
    "IN_PROCESS_BYTES",
    "PEER_TIMEOUT",
    "STALE_TMP_AGE",
    "TARGET_UNITS",
    "UNIT_BYTES",
    "prepare_tokens",
    "shard_folder",
    "unit_size",
    "unit_source",
    "write_unit",
]
