"""`meshlm generate` and `meshlm serve` across 2 processes × 4 simulated CPU devices over loopback
(jax.distributed, gloo), against the same command in this test process on 1 process × 8 devices.

The meshes span both processes: generate on 1,1,8,1 (tensor parallel: every layer's reductions cross
the processes), serve on 2,1,4,1 (the batch rows split over the processes).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

from meshlm import mesh as meshlib
from meshlm.models.policy import RunPolicy
from meshlm.serve.engine import multihost
from meshlm.serve.engine.sampling import SamplingParams, SlotSampling

F32 = RunPolicy(dtype="float32", param_dtype="float32")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def main("
MAX_TOKENS = 12
GENERATE_MESH = "1,1,8,1"
SERVE_FLAGS = ["--mesh_dim=2,1,4,1", "--max_batch=2", "--max_seq_len=64", "--prefill_buckets=32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The `test` preset with random weights and a byte-level tokenizer, as `meshlm export` writes it."""
    from meshlm.checkpoint.convert import save_params
    from meshlm.data.tokenizer import train_tokenizer
    from meshlm.models.placement import place
    from meshlm.models.presets import resolve_model

    root = tmp_path_factory.mktemp("model")
    cfg = resolve_model("test")
    one = meshlib.build_mesh(meshlib.parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
    train_tokenizer("stdlib", cfg.vocab_size, train_chars=400_000).save(root / "tokenizer")
    return save_params(
        jax.device_get(place(cfg, one, policy=F32).init(seed=0)), cfg, root / "test", tokenizer_dir=root / "tokenizer"
    )


@pytest.fixture(scope="module")
def reference(checkpoint) -> str:
    """What `meshlm generate` prints in one process on 8 devices (this test process's)."""
    from meshlm.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert (
            main(
                [
                    "generate",
                    f"--checkpoint={checkpoint}",
                    f"--mesh_dim={GENERATE_MESH}",
                    f"--prompt={PROMPT}",
                    f"--max_tokens={MAX_TOKENS}",
                    "--temperature=0",
                ]
            )
            == 0
        )
    assert text.getvalue().startswith(PROMPT) and len(text.getvalue()) > len(PROMPT) + 1, text.getvalue()
    return text.getvalue()


class Cluster:
    """`meshlm COMMAND` in 2 local processes; each one's stdout and stderr in files under `logs`."""

    def __init__(self, command: str, flags: list[str], logs: Path, n: int = 2):
        self.logs = logs
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        self.procs = []
        for pid in range(n):
            cmd = [
                sys.executable,
                "-m",
                "meshlm",
                command,
                "--devices=4",
                *flags,
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={n}",
                f"--process_id={pid}",
            ]
            with open(logs / f"p{pid}.out", "w") as out, open(logs / f"p{pid}.err", "w") as err:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=ROOT))

    def out(self, pid: int) -> str:
        return (self.logs / f"p{pid}.out").read_text()

    def err(self, pid: int) -> str:
        return (self.logs / f"p{pid}.err").read_text()

    def logs_text(self) -> str:
        return "".join(f"\n--- process {k} stderr:\n{self.err(k)[-2500:]}" for k in range(len(self.procs)))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in self.procs]

    def wait_for_http(self, http: httpx.Client, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError("a process ended before serving:" + self.logs_text())
            try:
                if http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not start:" + self.logs_text())

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def cluster(tmp_path):
    started: list[Cluster] = []

    def start(command: str, flags: list[str]) -> Cluster:
        started.append(Cluster(command, flags, tmp_path))
        return started[-1]

    yield start
    for c in started:
        c.kill()


def serve_flags(checkpoint: Path, port: int, *extra: str) -> list[str]:
    return ["--checkpoint", str(checkpoint), f"--port={port}", *SERVE_FLAGS, *extra]


def local_client(port: int) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False)  # no proxy: loopback only


# ------------------------------------------------------------------------------------- no processes


class _Store:
    """The coordinator's key-value store, in memory."""

    def __init__(self):
        self.kv: dict[str, bytes | str] = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    key_value_set = key_value_set_bytes

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        self.kv = {k: v for k, v in self.kv.items() if k != key and not k.startswith(key + "/")}


def test_steps_arrive_in_order_and_read_blocks_are_deleted():
    store = _Store()
    leader, followers = multihost.Leader(3, store), [multihost.Follower(k, store) for k in (1, 2)]
    settings = SlotSampling.host([SamplingParams(0.7, 5, 0.9, seed=3), SamplingParams(0.0)], [1, 2])
    tokens, lengths, slots = (
        np.arange(8, dtype=np.int32).reshape(2, 4),
        np.array([4, 1], np.int32),
        np.array([0, 2], np.int32),
    )
    leader.prefill(tokens, lengths, slots, settings)
    step = followers[0].receive()
    assert step.kind == "prefill"
    for got, want in zip((*step.args[:3], *step.args[3]), (tokens, lengths, slots, *settings)):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
    B = multihost.BLOCK
    for i in range(3 * B - 1):  # steps 1 .. 3B-1: blocks 0, 1, 2 are full
        leader.decode(1 + i % 4, 64)
    assert [followers[0].receive() for _ in range(2)] == [
        multihost.Step("decode", (1, 64)),
        multihost.Step("decode", (2, 64)),
    ]

    def blocks():
        return sorted({int(k.split("/")[3]) for k in store.kv if k.startswith(multihost.STEP_PREFIX)})

    assert blocks() == [0, 1, 2]  # process 2 has read nothing yet: everything is kept
    for _ in range(2 * B):
        followers[1].receive()
    for _ in range(2 * B - 3):  # both have read blocks 0 and 1 now
        followers[0].receive()
    for _ in range(B):  # when process 0 ends the next block, it deletes the two both have read
        leader.decode(1, 64)
    assert blocks() == [2, 3]
    leader.stop()
    leader.stop()  # once
    rest = [followers[1].receive() for _ in range(2 * B + 1)]
    assert rest[-1].kind == "stop" and all(s.kind == "decode" for s in rest[:-1])


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_signalled_follower_waits_for_process_0_then_gives_up():
    follower = multihost.Follower(1, _Store())
    with multihost.signals_wait_for_leader(follower, grace_s=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(TimeoutError, match="process 0 did not stop"):
            follower.receive()


def test_serve_and_generate_take_the_cluster_flags_of_train(capsys):
    from meshlm.cli import main

    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert all(
            f"--{flag}" in text
            for flag in ("coordinator_address", "num_processes", "process_id", "peer_timeout", "connect_timeout")
        ), text
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshlm",
            "serve",
            "--checkpoint=x",
            "--num_processes=2",
            "--process_id=2",
            "--coordinator_address=127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip()
        == "error: --process_id=2 is not in 0 .. 1 (--num_processes=2); number the processes from 0"
    ), r.stderr


# ---------------------------------------------------------------------------- 2 real processes


@pytest.mark.slow
def test_generate_across_two_processes_prints_what_one_does(checkpoint, reference, cluster):
    c = cluster(
        "generate",
        [
            f"--checkpoint={checkpoint}",
            f"--mesh_dim={GENERATE_MESH}",
            f"--prompt={PROMPT}",
            f"--max_tokens={MAX_TOKENS}",
            "--temperature=0",
        ],
    )
    assert c.wait(timeout=300) == [0, 0], c.logs_text()
    assert c.out(0) == reference  # the text alone: the collectives' connection notes are not in it
    assert c.out(1) == "" and c.err(1) == "", c.logs_text()  # process 0 prints, the other follows
    assert "2 processes × 4 devices; across hosts --dcn_mesh_dim=1,1,2,1" in c.err(0)


@pytest.mark.slow
def test_serve_across_two_processes_answers_and_stops_cleanly(checkpoint, reference, cluster):
    port = free_port()
    c = cluster("serve", serve_flags(checkpoint, port))
    http = local_client(port)
    c.wait_for_http(http)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    replies = {}

    def whole():
        replies["whole"] = http.post("/v1/completions", json=body)

    def streamed():
        events = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
        replies["stream"] = events

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]  # two rows of one batch
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    want = reference[len(PROMPT) : -1]
    assert replies["whole"].status_code == 200, replies["whole"].text
    assert replies["whole"].json()["choices"][0]["text"] == want
    assert replies["stream"][-1] == "[DONE]" and len(replies["stream"]) > 2, replies["stream"]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in replies["stream"][:-1]) == want

    c.procs[0].send_signal(signal.SIGTERM)  # to process 0's supervisor, as a cluster or Ctrl-C would
    assert c.wait(timeout=60) == [0, 0], c.logs_text()
    assert "error" not in c.err(0).lower() + c.err(1).lower(), c.logs_text()


@pytest.mark.slow
def test_killing_the_follower_stops_the_server_with_one_line(checkpoint, cluster):
    port = free_port()
    c = cluster("serve", serve_flags(checkpoint, port, "--peer_timeout=5"))
    c.wait_for_http(local_client(port))
    c.procs[1].kill()
    t0 = time.monotonic()
    rc = c.procs[0].wait(timeout=90)
    elapsed = time.monotonic() - t0
    errors = [line for line in c.err(0).splitlines() if line.startswith("error:")]
    assert rc != 0 and elapsed < 60, (rc, elapsed, c.logs_text())
    assert len(errors) == 1 and errors[0].startswith("error: process 0: process 1 "), c.logs_text()
