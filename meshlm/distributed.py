"""Several processes, one program: JAX's multi-controller runtime, set up from flags or the cluster.

Every process runs the same command; `initialize` joins them through `jax.distributed` (process 0
hosts the coordinator) before anything touches a device. On CPU the collectives run over gloo, so a
cluster can be rehearsed on one machine. Settings come from the flags `--coordinator_address`,
`--num_processes`, `--process_id`, else the `JAX_*` variables, else a cluster JAX detects, else one
process. Each process publishes a heartbeat and a watchdog exits with one line when a peer falls
silent for `peer_timeout` seconds; `run` and `supervise` run a command as a supervised worker.
docs/distributed.md, "How the processes find each other and fail", has the details.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshlm.errors import UsageError

ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}
# Variables whose presence means a cluster JAX can describe by itself.
CLUSTER_HINTS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")
DEFAULT_PEER_TIMEOUT = 20.0
_HEARTBEAT_EVERY = 1.0
_KEY = "meshlm/heartbeat/"
_STOPPED = "stopped:"  # a heartbeat value: this process left on a usage error (the message follows)
_USAGE_GRACE = 30.0  # process 0 keeps the coordinator up this long for the others to leave on their own
_leaving = threading.Lock()


@dataclass(frozen=True)
class Cluster:
    """How this process joins the others; `num_processes == 1` means it runs alone."""

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    auto_detect: bool = False  # let jax.distributed find the cluster from its environment
    peer_timeout: float = DEFAULT_PEER_TIMEOUT

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1 or self.auto_detect


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--{name}={value!r} must be an integer") from None


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    peer_timeout: float = DEFAULT_PEER_TIMEOUT,
    environ=None,
) -> Cluster:
    """The cluster from flags, then the JAX_* variables, then a cluster JAX recognises; checked."""
    environ = os.environ if environ is None else environ
    given: dict[str, Any] = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    for key, var in ENV.items():
        if given[key] is None and environ.get(var):
            given[key] = environ[var]
    if peer_timeout <= 0:
        raise UsageError(f"--peer_timeout={peer_timeout} must be a positive number of seconds")
    if all(v is None for v in given.values()):
        if any(environ.get(v) for v in CLUSTER_HINTS):
            return Cluster(auto_detect=True, peer_timeout=peer_timeout)
        return Cluster(peer_timeout=peer_timeout)
    n = _int(given["num_processes"], "num_processes") if given["num_processes"] is not None else None
    if n is None:
        raise UsageError("--num_processes is missing: give the number of processes with --coordinator_address")
    if n < 1:
        raise UsageError(f"--num_processes={n} must be ≥ 1")
    if n == 1:
        return Cluster(peer_timeout=peer_timeout)
    if given["process_id"] is None:
        raise UsageError("--process_id is missing: give each process its rank, 0 .. --num_processes - 1")
    pid = _int(given["process_id"], "process_id")
    if not 0 <= pid < n:
        raise UsageError(
            f"--process_id={pid} is not in 0 .. {n - 1} (--num_processes={n}); number the processes from 0"
        )
    address = str(given["coordinator_address"] or "")
    if not address:
        raise UsageError("--coordinator_address is missing: give HOST:PORT of process 0, the same for every process")
    _split_address(address)
    return Cluster(address, n, pid, peer_timeout=peer_timeout)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator_address={address!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Process k > 0: the coordinator's port must answer within `timeout` s, else a one-line error."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"cannot reach the coordinator at {address} within {timeout:g} s ({e.strerror or e}); "
                    "start process 0 first, or fix --coordinator_address"
                ) from None
            time.sleep(0.2)


_state: dict = {}


def initialize(cluster: Cluster, *, connect_timeout: float = 60.0) -> None:
    """Join the other processes (no-op for one process). Call before JAX touches a device."""
    if not cluster.multi_process or _state.get("cluster") is not None:
        return
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = int(max(2 * cluster.peer_timeout, 10))
    if cluster.auto_detect:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
    else:
        if cluster.process_id > 0 and cluster.coordinator_address is not None:
            wait_for_coordinator(cluster.coordinator_address, connect_timeout)
        jax.distributed.initialize(
            cluster.coordinator_address,
            cluster.num_processes,
            cluster.process_id,
            initialization_timeout=int(connect_timeout),
            heartbeat_timeout_seconds=heartbeat,
        )
    _state["cluster"] = cluster
    _state["watchdog"] = Watchdog(
        jax.process_index(), jax.process_count(), cluster.peer_timeout, cluster.coordinator_address
    )
    _state["watchdog"].start()


def finish() -> None:
    """Tell the others this process ended on purpose, so its silence is not taken for a crash."""
    watchdog = _state.get("watchdog")
    if watchdog is not None:
        watchdog.stop()


def folder_is_shared(folder, process_id: int, num_processes: int, timeout_s: float = 120.0) -> bool:
    """Whether every process sees the same `folder` (shared storage) rather than a folder of its own host:
    process 0 writes a fresh token there and publishes it in the coordinator's store; each process compares
    what it reads, and all learn whether every one of them matched."""
    from pathlib import Path

    if num_processes <= 1:
        return True
    client, probe = _client(), Path(folder) / ".meshlm-shared-probe"
    ms = int(timeout_s * 1000)
    if process_id == 0:
        token = os.urandom(8).hex()
        probe.parent.mkdir(parents=True, exist_ok=True)
        tmp = probe.with_name(f"{probe.name}.{token}.tmp")
        tmp.write_text(token)
        os.replace(tmp, probe)
        client.key_value_set("meshlm/shared_probe", token, allow_overwrite=True)
    token = client.blocking_key_value_get("meshlm/shared_probe", ms)
    seen = False
    for _ in range(10):  # a network file system may show the new file a moment late
        try:
            seen = probe.read_text() == token
        except OSError:
            seen = False
        if seen:
            break
        time.sleep(0.5)
    client.key_value_set(f"meshlm/shared_probe/{token}/{process_id}", "1" if seen else "0", allow_overwrite=True)
    return all(
        client.blocking_key_value_get(f"meshlm/shared_probe/{token}/{p}", ms) == "1" for p in range(num_processes)
    )


def _client():
    from jax._src import distributed  # the coordinator's key-value store has no public handle yet

    return distributed.global_state.client


class Watchdog(threading.Thread):
    """Heartbeats in the coordinator's store; exits the process when a peer or the coordinator goes quiet."""

    def __init__(
        self,
        process_id: int,
        num_processes: int,
        timeout: float,
        coordinator: str | None,
        exit=os._exit,
        clock=time.monotonic,
    ):
        super().__init__(name="meshlm-watchdog", daemon=True)
        self.pid, self.n, self.timeout, self.coordinator = process_id, num_processes, timeout, coordinator
        self._exit, self._clock = exit, clock
        self._stop_event = threading.Event()
        self._beat = 0

    def stop(self) -> None:
        self._stop_event.set()
        try:
            _client().key_value_set(f"{_KEY}{self.pid}", "done", allow_overwrite=True)
        except Exception:
            pass

    def _fail(self, message: str) -> None:
        print(f"error: process {self.pid}: {message}; stopping", file=sys.stderr, flush=True)
        self._exit(1)

    def check(self, client, seen: dict[int, tuple[str | None, float]], reachable_since: float) -> float:
        """One round: publish this process's beat, read the others'. Returns when the store last answered."""
        now = self._clock()
        try:
            self._beat += 1
            client.key_value_set(f"{_KEY}{self.pid}", str(self._beat), allow_overwrite=True)
            stored = dict(client.key_value_dir_get(_KEY))
        except Exception as e:
            if now - reachable_since > self.timeout:
                where = f" at {self.coordinator}" if self.coordinator else ""
                self._fail(
                    f"lost the coordinator{where} for {self.timeout:g} s (process 0 died or the "
                    f"network is down: {str(e).splitlines()[0][:120]})"
                )
            return reachable_since
        for k in range(self.n):
            beat = stored.get(f"{_KEY}{k}")
            if k == self.pid or beat == "done":
                continue
            if beat is not None and beat.startswith(_STOPPED):
                leave_on_usage_error(
                    self.pid,
                    f"process {k} stopped: {beat[len(_STOPPED) :]}",
                    self._exit,
                    client,
                    self.n,
                    clock=self._clock,
                )
                return now
            last = seen.get(k)
            if last is None or last[0] != beat:
                seen[k] = (beat, now)
            elif now - last[1] > self.timeout:
                self._fail(f"process {k} sent no heartbeat for {self.timeout:g} s (it died, hangs or lost the network)")
        return now

    def run(self) -> None:
        reachable = self._clock()
        seen: dict[int, tuple[str | None, float]] = {k: (None, reachable) for k in range(self.n)}
        client = _client()
        while not self._stop_event.wait(_HEARTBEAT_EVERY):
            reachable = self.check(client, seen, reachable)


# ------------------------------------------------------------------------------------ supervision
#
# JAX's runtime ends a process from C++ when the coordinator goes away or a peer stops sending
# heartbeats: an abort with a page of log and a stack trace, which no Python handler sees. So a
# multi-process `meshlm` command runs its work in a child process and watches it: the child's output
# passes through (less the runtime's chatter) and, if the child dies without saying why, the parent
# reads the runtime's last words and prints the one line a user needs.

WORKER_ENV = "MESHLM_WORKER"
_GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")
_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+)", re.S)


def is_worker() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def diagnose(log: str, cluster: Cluster, returncode: int) -> str:
    """One line for a child that died without saying why, from the runtime's last words."""
    me = f"process {cluster.process_id}"
    if m := _UNHEALTHY.search(log):
        ids = ", ".join(m.group(1).split())
        return f"{me}: process {ids} stopped sending heartbeats (it died or lost the network); stopping"
    if "heartbeat timeout" in log and (m := re.search(r"Task (\d+) heartbeat timeout", log)):
        return f"{me}: process {m.group(1)} stopped sending heartbeats (it died or lost the network); stopping"
    if "Socket closed" in log or "Connection refused" in log or "coordination service" in log.lower():
        return (
            f"{me}: lost the coordinator at {cluster.coordinator_address} (process 0 died or the network is "
            f"down); stopping"
        )
    if returncode < 0:
        return f"{me}: killed by {signal.Signals(-returncode).name}"
    return f"{me}: failed with exit status {returncode}; its output is above"


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it when its supervisor dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(argv: list[str], cluster: Cluster) -> int:
    """Run `python -m meshlm ARGV` as this process's worker; returns the exit status to use."""
    env = {**os.environ, WORKER_ENV: "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlm", *argv],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
        preexec_fn=_die_with_parent,
    )

    def forward(signum, _frame):
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    tail: collections.deque[str] = collections.deque(maxlen=400)
    said, crashing = False, False
    try:
        for line in proc.stderr or ():
            tail.append(line)
            said = said or line.startswith("error: ")
            crashing = crashing or bool(re.match(r"^[EF]\d{4} ", line))
            # The child's own one-line error always passes, even after the runtime began to log a crash.
            if line.startswith("error: ") or not (crashing or _GLOG.match(line) or line.startswith("[Gloo]")):
                sys.stderr.write(line)
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if rc in (0, 2) or said:
        return rc
    print(f"error: {diagnose(''.join(tail), cluster, rc)}", file=sys.stderr, flush=True)
    return 1


def run(
    command: str,
    argv: list[str],
    cluster: Cluster,
    work: Callable[[bool], Any],
    local_devices: int | None,
    connect_timeout: float = 60.0,
):
    """`work(main)` here alone, or in each process of the cluster: `main` is True on process 0.

    A process of several re-runs `meshlm COMMAND ARGV` as a supervised child (`supervise`), joins the
    others and runs `work` (`run_here`)."""
    if cluster.multi_process and not is_worker():
        return supervise([command, *argv], cluster)
    return run_here(cluster, work, local_devices, connect_timeout)


def run_here(cluster: Cluster, work: Callable[[bool], Any], local_devices: int | None, connect_timeout: float = 60.0):
    """`work(main)` in this process, after joining the cluster: an error in any process is one line and
    ends them all, and a process that dies stops the others within the cluster's peer timeout.
    `local_devices`: this process's simulated CPU devices (`--devices`), set before JAX starts together
    with the rest of the runtime (`meshlm.platform.configure_runtime`: XLA flags, compilation cache)."""
    from meshlm.platform import configure_runtime

    configure_runtime(local_devices)
    initialize(cluster, connect_timeout=connect_timeout)
    if not cluster.multi_process:
        return work(True)
    import jax

    try:
        result = work(jax.process_index() == 0)
    except UsageError as e:  # the others would wait for this one: all leave now, status 2
        leave_on_usage_error(jax.process_index(), str(e))
    except Exception as e:  # noqa: BLE001  (usually a collective failing because a peer died)
        fail_fast(e)
    finish()
    return result


def leave_on_usage_error(
    pid: int,
    message: str,
    exit=os._exit,
    client=None,
    n: int | None = None,
    grace: float = _USAGE_GRACE,
    clock=time.monotonic,
) -> None:
    """A usage error in one of `n` processes: one line, the others told through the coordinator's
    store (their watchdogs stop them with status 2 and the same message), then status 2. Process 0
    hosts the coordinator, so it leaves last: once every other process has left, or after `grace` s
    (a peer gone without a word). Leaving at once would cut the coordinator from under a peer still
    on its way, which the runtime then ends with a page of log instead of this line."""
    if not _leaving.acquire(blocking=False):  # the other thread of this process is already leaving
        threading.Event().wait()
    try:
        print(f"error: process {pid}: {message}", file=sys.stderr, flush=True)
        watchdog = _state.get("watchdog")
        if watchdog is not None:
            watchdog._stop_event.set()
            n = n or watchdog.n
        try:
            client = client or _client()
            client.key_value_set(
                f"{_KEY}{pid}", _STOPPED + (message.splitlines() or [""])[0][:500], allow_overwrite=True
            )
            deadline = clock() + grace
            while pid == 0 and clock() < deadline:
                stored = dict(client.key_value_dir_get(_KEY))
                if all(str(stored.get(f"{_KEY}{k}", "")).startswith((_STOPPED, "done")) for k in range(1, n or 1)):
                    break
                time.sleep(0.1)
        except Exception:  # noqa: BLE001  (no coordinator to tell: the others learn it from their watchdogs)
            pass
        sys.stdout.flush()
        exit(2)
    finally:
        _leaving.release()  # reached only where `exit` returns (tests)


def fail_fast(error: BaseException) -> None:
    """An error inside a multi-process run: one line, then exit at once (a clean shutdown would wait
    on peers that may be gone)."""
    pid = _state["cluster"].process_id if _state.get("cluster") else 0
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    watchdog = _state.get("watchdog")
    if watchdog is not None and watchdog.is_alive():
        # A collective fails the moment a peer's socket closes; give the watchdog the time to name it.
        print(
            f"process {pid}: {first}; waiting up to {watchdog.timeout + 2:g} s to learn which process is gone",
            file=sys.stderr,
            flush=True,
        )
        watchdog.join(watchdog.timeout + 2)
    print(f"error: process {pid}: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
