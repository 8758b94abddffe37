"""What the machine is and how JAX runs on it: simulated CPU devices, the dtype `auto` means, the
backend JAX will pick, the XLA options and flag presets, the compilation cache, the host allocator and
the share of device memory JAX takes. The backend profiles (`meshlm.backends`) choose among these.

Everything here runs before JAX initialises its backends, so it imports JAX lazily and never starts
it. `configure_runtime` is what the commands that compile call first: `--devices=N` simulated CPU
devices, the flag preset for the backend (GPU flags in `XLA_FLAGS`, TPU flags in `LIBTPU_INIT_ARGS`;
a variable the user set wins whole; `MESHLM_XLA_PRESET=0` turns presets and the CPU's program options
off), and a persistent compilation cache in `<meshlm cache>/jax` (`MESHLM_COMPILATION_CACHE=0`: off).
`detect_backend` decides the backend without starting JAX: `JAX_PLATFORMS` when set, else the one
already running, else a TPU (libtpu and TPU chips on the PCI bus), a GPU (a CUDA plugin and an NVIDIA
device node), or the CPU. docs/kernels.md ("Backend profiles") says what each setting was measured at.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from meshlm.errors import UsageError

OFF = ("0", "false", "off", "no")

# Flag presets: {environment variable: [flags]}. An unknown flag (or a bad value) aborts the process
# when the backend starts, so every name here was checked against the XLA in the jaxlib/libtpu these
# versions pin (tests/test_platform.py starts a backend with each preset).
GPU_FLAGS = [
    # Schedule the asynchronous collectives (fsdp all-gathers, gradient reduce-scatters, dp
    # all-reduces) around the matmuls so that they overlap with compute instead of running between
    # kernels. XLA:GPU already runs collectives asynchronously; this decides where they start and end.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Give the collectives' stream the highest CUDA priority, so a queue of compute kernels does not
    # delay the start the scheduler planned for them.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # The layers run as one scanned loop: issue layer i+1's parameter all-gather while layer i
    # computes, and let the backward's gradient reduce-scatter / all-reduce of layer i finish during
    # the next iteration (XLA's collective pipeliner over while loops).
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # Unroll that loop by two so the pipelined collectives write into alternating buffers (no copy
    # of a gathered layer per iteration).
    "--xla_gpu_enable_while_loop_double_buffering=true",
    # Combine small collectives into one launch up to 128 MiB of result: a layer's attention
    # projections and norm scales travel together, while two MLP matrices of an 8B model
    # (4096 × 14336, 117 MB each in bf16) never do, so combining adds about one matrix to the peak.
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    # By default only collectives along the same dimension combine; q/k/v/o and the MLP matrices
    # are gathered along different ones.
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
]
TPU_FLAGS = [
    # Overlap collectives with compute: the latency-hiding scheduler places them ...
    "--xla_tpu_enable_latency_hiding_scheduler=true",
    # ... as asynchronous collective fusions that run beside the TensorCore's work,
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    # each free to span several compute steps, fsdp's parameter all-gathers asynchronous too. (Fusing
    # all-gathers into those fusions is left out: newer libtpu refuses it outside TPU v5e, naming
    # wrong results and hangs as the risk.)
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_enable_async_all_gather=true",
    # Overlap the data-parallel gradient all-reduce with the backward pass, also when the gradients
    # it combines differ in size.
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
]
PRESETS = {"gpu": {"XLA_FLAGS": GPU_FLAGS}, "tpu": {"LIBTPU_INIT_ARGS": TPU_FLAGS}, "cpu": {}}

# JAX's GPU client takes this share of device memory unless told otherwise (jaxlib's
# generate_pjrt_gpu_plugin_options passes no fraction; XLA's GPU allocator defaults to 0.75). With
# preallocation off the allocator grows on demand up to the same cap.
DEFAULT_GPU_MEMORY_FRACTION = 0.75


# ------------------------------------------------------------------------------------ devices, dtypes

# A pipelined train step on simulated CPU devices keeps XLA:CPU's default scheduler: the concurrency-
# optimised one can deadlock a pipeline's collectives against fsdp's (docs/kernels.md, "Backend profiles").
PIPELINE_CPU_COMPILER_OPTIONS = {"xla_cpu_enable_concurrency_optimized_scheduler": False}

# On a CPU with AVX-512, XLA:CPU's own loops (norms, SwiGLU, softmax, the optimizer) vectorised 512 bits
# wide instead of 256; the matmuls are the matmul library's either way (docs/kernels.md).
WIDE_VECTOR_CPU_COMPILER_OPTIONS = {"xla_cpu_prefer_vector_width": 512}


def compiler_options(
    platform: str, *, pipelined: bool = False, cpuinfo: str | None = None, environ=None
) -> dict | None:
    """The XLA options meshlm's train and eval programs compile with on `platform` (None: XLA's
    defaults). On CPU: 512-bit loops where the CPU has AVX-512, unless `MESHLM_XLA_PRESET=0` or the
    user's `XLA_FLAGS` chooses a vector width itself; a pipelined step keeps XLA:CPU's default
    scheduler (`PIPELINE_CPU_COMPILER_OPTIONS`). GPU and TPU take theirs from the flag presets."""
    if platform != "cpu":
        return None
    environ = os.environ if environ is None else environ
    options = dict(PIPELINE_CPU_COMPILER_OPTIONS) if pipelined else {}
    preset = environ.get("MESHLM_XLA_PRESET", "").strip().lower() not in OFF
    if (
        preset
        and "avx512f" in _cpu_flags(cpuinfo)
        and "xla_cpu_prefer_vector_width" not in environ.get("XLA_FLAGS", "")
    ):
        options.update(WIDE_VECTOR_CPU_COMPILER_OPTIONS)
    return options or None


def simulated_device_flags(xla_flags: str, devices: int) -> str:
    """`xla_flags` asking for `devices` simulated CPU devices (replacing any earlier count)."""
    flags = [f for f in xla_flags.split() if "xla_force_host_platform_device_count" not in f]
    return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


def configure_devices(devices: int | None) -> None:
    """`--devices=N`: N simulated CPU devices (XLA's host device count), CPU only."""
    if devices is None:
        return
    os.environ["XLA_FLAGS"] = simulated_device_flags(os.environ.get("XLA_FLAGS", ""), devices)
    os.environ["JAX_PLATFORMS"] = "cpu"


_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 or AMX; Arm's BF16 extension


def _cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 `flags`, Arm `Features`); empty if unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_multiplies_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bfloat16 matmul instructions (from /proc/cpuinfo's flags). XLA:CPU's bf16
    dots use them and then beat float32's; without them bf16 is emulated and slower."""
    return bool(_BF16_CPU_FLAGS & _cpu_flags(cpuinfo))


def default_dtype(backend: str, serving: bool = False) -> str:
    """The compute dtype `auto` stands for: bfloat16 on GPU and TPU, and for training on a CPU with
    bf16 matmul instructions (parameters and optimizer state stay float32); float32 on other CPUs,
    and for serving on any CPU (its weights are held in the compute dtype)."""
    if backend != "cpu":
        return "bfloat16"
    return "bfloat16" if not serving and cpu_multiplies_bf16() else "float32"


def resolve_dtype(dtype: str, backend: str | None = None, serving: bool = False) -> str:
    """`dtype` with `auto` replaced for `backend` (default: the backend JAX runs on here)."""
    if dtype != "auto":
        return dtype
    if backend is None:
        import jax

        backend = jax.default_backend()
    return default_dtype(backend, serving)


# ------------------------------------------------------------------------------------ which backend


def platform_kind(name: str) -> str:
    """'gpu', 'tpu' or 'cpu' for a JAX platform name (cuda and rocm are GPUs)."""
    name = name.strip().lower()
    return "gpu" if name in ("gpu", "cuda", "rocm") else "tpu" if name == "tpu" else "cpu"


def _started_backend() -> str | None:
    """The backend JAX runs on, if it has started (never starts it)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None or not bridge.backends_are_initialized():
        return None
    import jax

    return platform_kind(jax.default_backend())


def _tpu_chips() -> int:
    try:
        from jax._src import hardware_utils  # JAX's own PCI scan; importing jax does not start it

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except Exception:  # noqa: BLE001  (a private helper: treat its absence as no TPU)
        return 0


def _nvidia_device() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))


def _named_platforms(environ) -> str:
    """The platforms the user named: `JAX_PLATFORMS`, else `jax_platforms` set through jax.config.update."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if not platforms and "jax" in sys.modules:
        platforms = (sys.modules["jax"].config.jax_platforms or "").strip()
    return platforms


def _libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def _cuda_present() -> bool:
    """A JAX CUDA plugin installed and an NVIDIA device node present."""
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")) and _nvidia_device()


def detect_backend(environ=None) -> str:
    """'gpu', 'tpu' or 'cpu': the backend JAX will run on here, decided without starting JAX."""
    environ = os.environ if environ is None else environ
    platforms = _named_platforms(environ)
    if platforms:
        return platform_kind(platforms.split(",")[0])
    started = _started_backend()
    if started:
        return started
    if _libtpu_installed() and _tpu_chips() > 0:
        return "tpu"
    return "gpu" if _cuda_present() else "cpu"


def skip_absent_tpu(environ=None) -> str | None:
    """On a machine without TPU chips but with libtpu installed (to compile for TPU topologies ahead of
    time), JAX would still start libtpu at its first device query, and libtpu prints five lines of
    warnings about accelerator types and worker hostnames before JAX falls back. Name the platforms JAX
    may start instead (`cuda,cpu` where a CUDA plugin and an NVIDIA device are present, else `cpu`);
    compiling for a TPU topology (`meshlm plan --verify`) does not need the TPU backend started. Leaves
    platforms the user named, and a JAX that already runs, alone. Returns what it set, or None."""
    environ = os.environ if environ is None else environ
    if _named_platforms(environ) or _started_backend() or not _libtpu_installed() or _tpu_chips() > 0:
        return None
    platforms = "cuda,cpu" if _cuda_present() else "cpu"
    environ["JAX_PLATFORMS"] = platforms
    jax = sys.modules.get("jax")  # imported by now if not before (_tpu_chips uses JAX's PCI scan)
    if jax is not None and environ is os.environ:  # JAX read the variable at import: tell its config too
        jax.config.update("jax_platforms", platforms)
    return platforms


# ------------------------------------------------------------------------------------ runtime settings


def xla_flag_preset(backend: str) -> dict[str, str]:
    """{environment variable: flags} meshlm sets for `backend` ('gpu', 'tpu', 'cpu'); {} on CPU."""
    return {var: " ".join(flags) for var, flags in PRESETS[platform_kind(backend)].items()}


def apply_xla_flag_preset(backend: str | None = None, environ=None) -> dict[str, str]:
    """Set the preset's variables for `backend` (default: `detect_backend`) where they are unset;
    returns what it set. Does nothing with `MESHLM_XLA_PRESET=0`, or for a variable the user set (a
    parent process that applied the preset counts as the user: its children inherit the same flags).
    Only a backend that has not started yet reads them."""
    environ = os.environ if environ is None else environ
    if environ.get("MESHLM_XLA_PRESET", "").strip().lower() in OFF:
        return {}
    applied = {}
    for var, flags in xla_flag_preset(backend or detect_backend(environ)).items():
        if not environ.get(var, "").strip():
            environ[var] = applied[var] = flags
    return applied


def compilation_cache_dir(environ=None) -> Path | None:
    """The folder for JAX's persistent compilation cache: `<meshlm cache>/jax`, or None with
    `MESHLM_COMPILATION_CACHE=0`."""
    environ = os.environ if environ is None else environ
    if environ.get("MESHLM_COMPILATION_CACHE", "").strip().lower() in OFF:
        return None
    root = environ.get("MESHLM_CACHE") or Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshlm"
    return Path(root).expanduser() / "jax"


def enable_compilation_cache(environ=None) -> str | None:
    """Point JAX's persistent compilation cache at `compilation_cache_dir` unless the user named a
    folder (`JAX_COMPILATION_CACHE_DIR`) or turned it off; returns the folder in use, or None. A
    folder that cannot be created leaves the cache off rather than failing the run."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = compilation_cache_dir(environ)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return str(path)


def configure_runtime(devices: int | None = None) -> None:
    """What every command that compiles runs first, before JAX starts: `--devices`, the XLA flag
    preset for the backend, the persistent compilation cache. In a process where JAX already runs
    (a notebook, a test session calling `train(cfg)`) it changes nothing: the flags could no longer
    take effect, and a cache is the caller's choice there."""
    configure_devices(devices)
    if _started_backend():
        return
    apply_xla_flag_preset()
    enable_compilation_cache()


# ------------------------------------------------------------------------------------ host memory

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
# What the step's host allocator keeps: every freed byte (nothing trimmed back to the kernel), heaps
# grown 64 MiB at a time (glibc's largest per-thread heap), and no allocation served by its own mmap.
HOST_ALLOCATOR_SETTINGS = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1, _M_TOP_PAD: 64 << 20}
_MALLOC_VARIABLES = (
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)
_host_allocator_kept: bool | None = None
# The largest block glibc serves from a thread's own heap (HEAP_MAX_SIZE on 64-bit: 2 × the 32 MiB mmap
# threshold's ceiling); a larger one is mmap'd and unmapped whatever the settings, so a step whose
# scratch is larger faults it in anew every run.
KEPT_BLOCK_BYTES = 64 << 20


def allocator_left_alone(environ) -> bool:
    """Whether `environ` asks meshlm to leave malloc as it is: the user tuned it (`MALLOC_*` variables,
    `GLIBC_TUNABLES` with glibc.malloc), or `MESHLM_HOST_ALLOCATOR=0`."""
    tuned = any(v in environ for v in _MALLOC_VARIABLES) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")
    return tuned or environ.get("MESHLM_HOST_ALLOCATOR", "").strip().lower() in OFF


def keep_host_memory(environ=None) -> bool:
    """Have glibc's malloc keep the memory a CPU step frees, for the next step; True where it was set.

    XLA:CPU allocates each run's scratch (a device's activations, the gradients of a layer) anew and
    frees it at the end. glibc serves a block above its mmap threshold (at most 32 MiB) with a fresh
    mmap and unmaps it when freed, and trims freed heap memory back to the kernel; the next step then
    faults every page in again, zero-filled (docs/kernels.md measures it). Leaves the allocator alone where the
    user tuned it through the environment (`MALLOC_*_` variables, `GLIBC_TUNABLES` with
    glibc.malloc), where the C library is not glibc, and with `MESHLM_HOST_ALLOCATOR=0`."""
    global _host_allocator_kept
    if _host_allocator_kept is not None:
        return _host_allocator_kept
    _host_allocator_kept = False
    if allocator_left_alone(os.environ if environ is None else environ) or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        os.confstr("CS_GNU_LIBC_VERSION")  # raises where the C library is not glibc
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return False
    _host_allocator_kept = all(mallopt(param, value) == 1 for param, value in HOST_ALLOCATOR_SETTINGS.items())
    return _host_allocator_kept


# ------------------------------------------------------------------------------------ device memory


def gpu_memory_fraction(environ=None) -> tuple[float, str]:
    """(share of each GPU's memory JAX may use, which setting says so), read as jaxlib reads it:
    `XLA_CLIENT_MEM_FRACTION` (or the older `XLA_PYTHON_CLIENT_MEM_FRACTION`), else 0.75 whether or
    not memory is preallocated; `XLA_PYTHON_CLIENT_ALLOCATOR=platform` allocates on demand with no cap."""
    environ = os.environ if environ is None else environ
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform"
    new, old = environ.get("XLA_CLIENT_MEM_FRACTION", ""), environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    if new and old:
        raise UsageError(
            "XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set; "
            "unset XLA_PYTHON_CLIENT_MEM_FRACTION (JAX refuses both)"
        )
    var = "XLA_CLIENT_MEM_FRACTION" if new else "XLA_PYTHON_CLIENT_MEM_FRACTION"
    value = new or old
    if not value:
        return DEFAULT_GPU_MEMORY_FRACTION, "JAX's default GPU memory fraction"
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise UsageError(f"{var}={value}: give a fraction of device memory in (0, 1], e.g. 0.9")
    return fraction, f"{var}={value}"
