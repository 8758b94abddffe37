"""The hardware catalog: what one device can compute, hold and send.

Every figure is per device (one GPU, one TPU chip) and in SI units: FLOP/s, bytes, bytes/s.
`fast_bandwidth` is what one device pushes into a collective along one mesh axis inside the fast
domain (NVLink, ICI), one direction; `slow_bandwidth` is its share of the host's NICs (InfiniBand,
DCN). `resolve_hardware` budgets memory as JAX's client gets it (on GPUs 75% unless the XLA client
variables say otherwise). docs/plan.md, "The hardware catalog", says how the figures are read.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

from meshlm.errors import UsageError
from meshlm.flops import detect_peak_flops


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16: float  # dense matmul FLOP/s in bfloat16
    peak_fp32: float  # dense matmul FLOP/s for float32 inputs at JAX's default precision (TF32 / bf16 passes)
    hbm_bytes: float  # device memory the planner budgets: the datasheet's × memory_fraction
    hbm_bandwidth: float  # device memory bytes/s
    fast_bandwidth: float  # bytes/s one way, per device, per mesh axis inside the fast domain
    slow_bandwidth: float  # bytes/s one way, per device, across fast domains
    fast_domain: int  # devices one fast domain holds (an NVLink server, a TPU slice / pod)
    devices_per_host: int
    fast_name: str = "NVLink"
    slow_name: str = "InfiniBand"
    source: str = ""
    memory_fraction: float = 1.0  # the share of the device's memory JAX takes
    memory_setting: str = ""  # which setting decided memory_fraction
    peak_source: str = "datasheet peak, the table meshlm train's MFU uses"  # where peak_* come from
    collective_latency: float = 0.0  # seconds each collective costs beyond its bytes (simulated devices' rendezvous)
    matmul_rows: tuple[tuple[int, float], ...] = ()  # measured (rows per device, fraction of peak); () = peak
    ring_step_s: float = 0.0  # seconds each step of a RingAttention loop costs beyond its FLOPs and collectives
    attention_efficiency: float = 1.0  # the fraction of peak the attention kernel runs at (1: not measured)
    # On-chip memory (TPU VMEM) in which the compiler keeps temporaries of the step that would otherwise sit in
    # HBM at its peak, as calibrated against compiled programs (`meshlm.plan.memory`); 0 where the compiled
    # peak is not lowered that way or was not measured.
    onchip_bytes: float = 0.0
    device_kind: str = ""  # what JAX's `device.device_kind` says for this chip ("TPU v5 lite"); "" for cpu

    def matmul_efficiency(self, rows: float) -> float:
        """The fraction of peak a matmul of `rows` rows per device runs at: measured points of
        `matmul_rows` interpolated in log(rows) and held flat beyond them; 1 where nothing was measured."""
        points = self.matmul_rows
        if not points:
            return 1.0
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, e0), (r1, e1) in zip(points, points[1:]):
            if rows <= r1:
                t = math.log(rows / r0) / math.log(r1 / r0)
                return e0 + t * (e1 - e0)
        return points[-1][1]

    @property
    def memory_note(self) -> str:
        """How the budget was derived, e.g. "75% of 80 GB (JAX's default GPU memory fraction)"; empty
        when JAX takes the whole device."""
        if self.memory_fraction == 1.0:
            return ""
        return (
            f"{self.memory_fraction:.0%} of {self.hbm_bytes / self.memory_fraction / 1e9:.3g} GB "
            f"({self.memory_setting})"
        )

    def peak_flops(self, dtype: str) -> float:
        """Peak matmul FLOP/s for this compute dtype."""
        return self.peak_fp32 if str(dtype) in ("float32", "fp32", "f32") else self.peak_bf16

    @property
    def backend(self) -> str:
        """The XLA backend that compiles for this hardware (`backend_of`)."""
        return backend_of(self.name)

    @property
    def ridge_intensity(self) -> float:
        """Hardware arithmetic intensity of the fast link: peak bf16 FLOP/s per byte/s (MaxText's ratio)."""
        return self.peak_bf16 / self.fast_bandwidth


def backend_of(name: str) -> str:
    """'tpu', 'gpu' or 'cpu': the XLA backend that compiles for the hardware of this catalog name; its
    compiler decides some collectives (`meshlm.plan.comms.predict`)."""
    return "tpu" if name.startswith("tpu") else "cpu" if name == "cpu" else "gpu"


def _peaks(device_kind: str) -> tuple[float, float]:
    """(bf16, fp32) peaks from the datasheet table that MFU logging uses, so the two never disagree."""
    bf16 = detect_peak_flops(device_kind, "bfloat16")
    fp32 = detect_peak_flops(device_kind, "float32")
    assert bf16 and fp32, device_kind
    return bf16[0], fp32[0]


def _gpu(name, kind, hbm, hbm_bw, nvlink, ib, source, **measured) -> Hardware:
    bf16, fp32 = _peaks(kind)
    return Hardware(
        name,
        bf16,
        fp32,
        hbm,
        hbm_bw,
        nvlink,
        ib,
        fast_domain=8,
        devices_per_host=8,
        source=source,
        device_kind=kind,
        **measured,
    )


# Hopper (H100, H200): the fractions of peak `bench/accelerator.py`'s step (llama3-8b layers at 8192 tokens
# per device) ran its matmuls and cuDNN's attention at on an H200 (docs/plan.md, "Where the hardware
# numbers come from"). The H100 has the same tensor cores and clocks; fewer rows per device are held at
# this figure.
HOPPER = dict(matmul_rows=((8192, 0.712),), attention_efficiency=0.378)


def _tpu(name, kind, hbm, hbm_bw, ici_link, dcn_per_chip, pod, per_host, source, onchip=0.0) -> Hardware:
    bf16, fp32 = _peaks(kind)
    return Hardware(
        name,
        bf16,
        fp32,
        hbm,
        hbm_bw,
        2 * ici_link,
        dcn_per_chip,
        fast_domain=pod,
        devices_per_host=per_host,
        fast_name="ICI",
        slow_name="DCN",
        source=source,
        onchip_bytes=onchip,
        device_kind=kind,
    )


# On-chip memory for the step's temporaries: XLA:TPU's memory-space assignment gets each TensorCore's
# VMEM less what it keeps for kernels' scratch, and on v5e it takes what the HBM peak would hold. On v5p
# it does not lower the peak, on v6e only some meshes' (not modelled); v4 is not measured. The VMEM each
# compile allots and the peaks with and without it: docs/plan.md, "Accuracy on TPU".
V5E_ONCHIP = 112 * 2**20


# One entry a row or two, as the datasheets list them: the formatter leaves the table as written.
# fmt: off
CATALOG: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s bidirectional (450 one way);
    # DGX H100: 8 GPUs, 8 x 400 Gb/s ConnectX-7 (50 GB/s per GPU). Peaks: meshlm.flops.PEAK_TABLE.
    "h100": _gpu("h100", "NVIDIA H100 80GB HBM3", 80e9, 3.35e12, 450e9, 50e9,
                 "NVIDIA H100 SXM5 and DGX H100 datasheets", **HOPPER),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; same NVLink 4 and ConnectX-7 as DGX H100.
    "h200": _gpu("h200", "NVIDIA H200", 141e9, 4.8e12, 450e9, 50e9, "NVIDIA H200 SXM and DGX H200 datasheets",
                 **HOPPER),
    # NVIDIA A100 SXM4 80GB datasheet: 2,039 GB/s; NVLink 3 600 GB/s bidirectional (300 one way);
    # DGX A100: 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    "a100": _gpu("a100", "NVIDIA A100-SXM4-80GB", 80e9, 2.039e12, 300e9, 25e9,
                 "NVIDIA A100 SXM4 and DGX A100 datasheets"),
    # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e and 64 TB/s for 8 GPUs (180 GB, 8 TB/s each); NVLink 5
    # 1.8 TB/s bidirectional (900 GB/s one way); 8 x 400 Gb/s ConnectX-7. HGX B200 (1,000 W) dense
    # BF16 2,250 and TF32 1,100 TFLOP/s (the datasheet's 4.5 / 2.2 PFLOP/s are with 2:4 sparsity).
    "b200": Hardware("b200", 2250e12, 1100e12, 180e9, 8e12, 900e9, 50e9, fast_domain=8, devices_per_host=8,
                     source="NVIDIA DGX B200 / HGX B200 datasheets"),
    # TPU figures: Cloud TPU system-architecture pages (peak bf16, HBM, chips per host, pod size) and
    # "How to Scale Your Model" (Austin et al., 2025), TPU chapter, for ICI one-way bandwidth per link
    # and DCN (~25 GB/s per host for v4/v5p; v5e hosts 2 x 100 Gb/s, v6e hosts 4 x 200 Gb/s NICs).
    "tpu-v4": _tpu("tpu-v4", "TPU v4", 32e9, 1.2e12, 45e9, 25e9 / 4, 4096, 4, "Cloud TPU v4 docs; scaling book"),
    "tpu-v5e": _tpu("tpu-v5e", "TPU v5 lite", 16e9, 8.1e11, 45e9, 25e9 / 8, 256, 8, "Cloud TPU v5e docs; scaling book",
                    onchip=V5E_ONCHIP),
    "tpu-v5p": _tpu("tpu-v5p", "TPU v5p", 95e9, 2.76e12, 90e9, 25e9 / 4, 8960, 4, "Cloud TPU v5p docs; scaling book"),
    "tpu-v6e": _tpu("tpu-v6e", "TPU v6 lite", 32e9, 1.64e12, 90e9, 100e9 / 8, 256, 8,
                    "Cloud TPU v6e (Trillium) docs; scaling book; MaxText sharding guide"),
}
# fmt: on

NAMES = (*CATALOG, "cpu")
GPU_NAMES = tuple(name for name in CATALOG if backend_of(name) == "gpu")


# What the operating system and the process itself (Python, JAX, the compiler) keep of the host's memory
# beside a CPU step's buffers: a tenth of it and 2 GiB more.
OS_SHARE, OS_BYTES = 0.10, 2 * 2**30


def host_memory_bytes() -> float:
    """The host's memory: physical RAM, or the cgroup's limit where that is lower (a container)."""
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
        except OSError:
            continue
        if limit.isdigit():
            physical = min(physical, float(limit))
    return physical


def host_memory_budget() -> float:
    """Bytes a CPU job may use on this host: its memory (`host_memory_bytes`) less what the operating
    system keeps (`OS_SHARE`, `OS_BYTES`). Every simulated device of a process shares it."""
    total = host_memory_bytes()
    return max(0.0, total * (1 - OS_SHARE) - OS_BYTES)


def best_seconds(call, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `call()` (the probes' measure: the closest to what the
    machine can do when other jobs leave it alone)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_probe(n_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """Measured bytes/s of one large in-memory copy (the best of a few), what simulated collectives do."""
    import numpy as np

    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    return n_bytes / best_seconds(lambda: np.copyto(dst, src), repeats)


def collective_latency_probe(n_devices: int, chain: int = 16, repeats: int = 15) -> tuple[float, int]:
    """(seconds, devices): what one collective costs on this machine's simulated CPU devices beyond its
    bytes, and over how many devices it was measured (the first `n_devices` of this process; 0 s for one).

    Every collective of simulated devices is a rendezvous of all their threads, however few bytes it
    moves. The probe times a jitted chain of `chain` dependent all-reduces of a few bytes against a chain
    of one and keeps the best slope of `repeats` tries."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    devices = jax.local_devices(backend="cpu")[:n_devices]
    if len(devices) < 2:
        return 0.0, len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    x = jax.device_put(np.ones(len(devices) * 8, np.float32), jax.sharding.NamedSharding(mesh, PartitionSpec("x")))

    def timed(k: int) -> float:
        def body(v):
            for _ in range(k):
                v = jax.lax.psum(v, "x") * (1.0 / len(devices))
            return v

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x")))
        f(x).block_until_ready()  # compile + warm up
        return best_seconds(lambda: f(x).block_until_ready(), repeats)

    return max(0.0, (timed(chain + 1) - timed(1)) / chain), len(devices)


def matmul_rows_probe(
    n_devices: int,
    dtype: str,
    peak: float,
    rows: tuple[int, ...] = (64, 128, 256, 512, 1024),
    width: int = 512,
    repeats: int = 5,
) -> tuple[tuple[int, float], ...]:
    """((rows, fraction of `peak`), ...): how fast a [rows, width] @ [width, width] matmul runs on each of
    the first `n_devices` simulated CPU devices at once (the devices share the cores, as in a step),
    against `peak`, the whole machine's rate on one large matmul. Few rows per device (a small batch
    split many ways) run well below the peak: the probe measures by how much."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.local_devices(backend="cpu")[:n_devices]
    mesh = Mesh(np.array(devices), ("x",))
    split = NamedSharding(mesh, PartitionSpec("x"))
    w = jax.device_put(jnp.full((len(devices) * width, width), 1.0 / width, dtype), split)
    f = jax.jit(
        jax.shard_map(
            lambda x, w: (x @ w) @ w, mesh=mesh, in_specs=(PartitionSpec("x"),) * 2, out_specs=PartitionSpec("x")
        )
    )
    xs = [jax.device_put(jnp.ones((len(devices) * r, width), dtype), split) for r in rows]
    for x in xs:
        f(x, w).block_until_ready()  # compile + warm up each size
    best = [float("inf")] * len(rows)
    for _ in range(repeats):  # round-robin over the sizes: a burst of load elsewhere hits them all alike
        for i, x in enumerate(xs):
            t0 = time.perf_counter()
            f(x, w).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - t0)
    out = [(r, min(1.0, len(devices) * 4 * r * width * width / t / peak)) for r, t in zip(rows, best)]
    return tuple(out)


def ring_step_probe(n_devices: int, latency: float, local_len: int = 16, repeats: int = 7) -> float:
    """Seconds one step of meshlm's RingAttention loop costs on the first `n_devices` simulated CPU
    devices beyond its FLOPs and the rendezvous of its permute (`latency`, charged with the collectives):
    the loops' own bookkeeping, measured as the best of `repeats` forward + backward passes of the real
    kernel on a ring of all the devices at a size where the FLOPs are negligible (`local_len` tokens,
    one head of 16 per device). 0 for fewer than 2 devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from meshlm.ops.ring import ring_attention

    devices = jax.local_devices(backend="cpu")[:n_devices]
    sp = len(devices)
    if sp < 2:
        return 0.0
    mesh = Mesh(np.array(devices), ("sp",))
    length = sp * local_len
    x = jnp.full((1, length, 1, 16), 0.1, jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]

    def total(q, k, v):
        return ring_attention(
            q,
            k,
            v,
            q_positions=positions,
            kv_positions=positions,
            mesh=mesh,
            axis_name="sp",
            qkv_spec=PartitionSpec(None, "sp"),
            seq_spec=PartitionSpec(None, "sp"),
        ).sum()

    f = jax.jit(jax.grad(total, argnums=(0, 1, 2)))
    jax.block_until_ready(f(x, x, x))  # compile + warm up
    best = best_seconds(lambda: jax.block_until_ready(f(x, x, x)), repeats)
    return max(0.0, best / (2 * sp) - latency)  # a forward and a backward loop of sp steps each


def cpu_hardware(n_devices: int, dtype: str = "float32") -> Hardware:
    """This machine's CPU shared by `n_devices` simulated devices, every figure measured.

    Compute: the peak `meshlm train` uses for MFU on CPU (`meshlm.flops.matmul_probe`, the same
    size and duration, split evenly among the devices), so the two MFUs share one definition. It is
    measured on each run, so on a busy machine it moves between runs; `--peak_tflops` pins it.
    Memory: the host's memory less the operating system's share (`host_memory_budget`), split evenly:
    the devices share one RAM, so more of them hold no more. Links: simulated collectives are memory copies, so both
    domains get the measured copy bandwidth split among the devices, and each collective pays the
    measured rendezvous of the devices' threads (`collective_latency_probe`). Matmuls with few rows per
    device run below the peak: `matmul_rows_probe` measures the fraction at 64 to 1024 rows. Each step of
    a RingAttention loop costs about a millisecond of bookkeeping whatever its size (`ring_step_probe`).
    """
    from meshlm.flops import matmul_probe

    probe = matmul_probe(dtype, size=1024, seconds=1.0)
    peak = probe / n_devices
    copy = memcpy_probe() / n_devices
    latency, over = collective_latency_probe(n_devices)
    rows = matmul_rows_probe(n_devices, dtype, probe)
    ring_step = ring_step_probe(n_devices, latency)
    latency_note = (
        f"{latency * 1e6:.0f} µs per collective and {ring_step * 1e3:.2f} ms per ring step over {over} devices"
    )
    if over < n_devices:
        latency_note += f" (the {over} of the {n_devices} this process has)"
    return Hardware(
        "cpu",
        peak,
        peak,
        host_memory_budget() / n_devices,
        copy,
        copy,
        copy,
        fast_domain=n_devices,
        devices_per_host=n_devices,
        fast_name="memory",
        slow_name="memory",
        source=f"measured on this machine ({dtype} 1024^2 matmul, 64 MiB copy, {latency_note}), "
        f"split over {n_devices} devices",
        collective_latency=latency,
        matmul_rows=rows,
        ring_step_s=ring_step,
        peak_source=f"measured {dtype} 1024^2 matmul on this CPU: {probe / 1e9:.1f} GFLOP/s / {n_devices} "
        "devices, as meshlm train measures its MFU peak (re-measured each run: it moves with "
        "the machine's load; --peak_tflops pins it for both)",
    )


def with_peak(hw: Hardware, peak_tflops: float | None) -> Hardware:
    """`hw` with `--peak_tflops` as its peak in every dtype (what `meshlm train --peak_tflops` uses for MFU)."""
    if peak_tflops is None:
        return hw
    if not peak_tflops > 0:
        raise UsageError(f"--peak_tflops={peak_tflops} must be a positive number of TFLOP/s per device")
    return replace(
        hw, peak_bf16=peak_tflops * 1e12, peak_fp32=peak_tflops * 1e12, peak_source=f"--peak_tflops={peak_tflops:g}"
    )


def hardware_key(name: str) -> str:
    """The catalog name for `--hardware` (aliases: v4, v5e, v5p, v6e, trillium); UsageError if unknown."""
    key = name.strip().lower().replace("_", "-")
    key = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "trillium": "tpu-v6e"}.get(key, key)
    if key not in NAMES:
        raise UsageError(f"--hardware={name}: unknown hardware; choose one of {', '.join(NAMES)}")
    return key


def with_memory_fraction(hw: Hardware, fraction: float, setting: str) -> Hardware:
    """`hw` with only `fraction` of its datasheet memory budgeted, and why."""
    whole = hw.hbm_bytes / hw.memory_fraction
    source = hw.source if fraction == 1.0 else f"{hw.source}; memory: {fraction:.0%} ({setting})"
    return replace(hw, hbm_bytes=whole * fraction, memory_fraction=fraction, memory_setting=setting, source=source)


def resolve_hardware(
    name: str, n_devices: int, dtype: str = "bfloat16", devices_per_host: int | None = None
) -> Hardware:
    """Catalog entry (or the measured CPU) for `--hardware`, with `--devices_per_host` applied and,
    on GPUs, the memory JAX takes there (this process's environment: the run is assumed to share it)."""
    from meshlm.platform import gpu_memory_fraction

    key = hardware_key(name)
    hw = cpu_hardware(n_devices, dtype) if key == "cpu" else CATALOG[key]
    if hw.fast_name == "NVLink":  # a GPU
        hw = with_memory_fraction(hw, *gpu_memory_fraction())
    if devices_per_host is not None:
        if devices_per_host <= 0:
            raise UsageError(f"--devices_per_host={devices_per_host} must be a positive integer")
        # On GPUs NVLink stops at the server; a TPU slice's ICI spans hosts, so only the host size changes.
        fast = devices_per_host if hw.fast_name == "NVLink" else hw.fast_domain
        hw = replace(hw, devices_per_host=devices_per_host, fast_domain=fast)
    return hw


def device_memory_budget(device=None) -> float | None:
    """Bytes JAX's allocator may use on `device` (default: the first local device) as the running
    client reports it (`memory_stats()["bytes_limit"]`: the GPU fraction applied, the TPU's HBM), or
    None where the backend does not say (CPU). Starts JAX."""
    if device is None:
        import jax

        device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    return float(stats["bytes_limit"]) if stats.get("bytes_limit") else None
