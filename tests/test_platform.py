"""Runtime settings per backend (meshlm.platform): which backend JAX will pick, the XLA flag presets
(every flag known to the XLA that reads it), the persistent compilation cache across processes, the
memory share the planner budgets, and the number formats training refuses."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from meshlm import platform as P
from meshlm.cli import main
from meshlm.errors import UsageError
from meshlm.plan.hardware import resolve_hardware
from tests.support.cli import ROOT


def python(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with this environment, less XLA_FLAGS, plus `env`."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env},
    )


# ------------------------------------------------------------------------------------ backend, presets


@pytest.mark.parametrize(
    "platforms,backend",
    [("cuda", "gpu"), ("gpu", "gpu"), ("rocm", "gpu"), ("tpu,cpu", "tpu"), ("cpu", "cpu"), ("", "cpu")],
)
def test_backend_is_known_before_jax_starts(platforms, backend):
    # "" here: JAX already runs on CPU in this process; a fresh one probes for chips and plugins (none here)
    assert P.detect_backend({"JAX_PLATFORMS": platforms}) == backend


def test_libtpu_without_tpu_chips_starts_quietly_on_the_cpu():
    # The test extra installs libtpu (to compile for TPU topologies); this machine has no TPU chips.
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: nothing would start it")
    got = python(
        """
        import os, sys
        from meshlm import platform
        set_to = platform.skip_absent_tpu()
        import jax
        print(set_to, jax.devices()[0].platform, os.environ["JAX_PLATFORMS"])
        assert platform.skip_absent_tpu() is None  # JAX_PLATFORMS is set now: left alone
    """,
        JAX_PLATFORMS="",
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["cpu", "cpu", "cpu"]
    assert "TPU_ACCELERATOR_TYPE" not in got.stderr and "TPU_WORKER_HOSTNAMES" not in got.stderr, got.stderr


def test_platforms_the_user_named_are_kept():
    env = {"JAX_PLATFORMS": "tpu,cpu"}
    assert P.skip_absent_tpu(env) is None and env == {"JAX_PLATFORMS": "tpu,cpu"}


def test_presets_per_backend():
    assert P.xla_flag_preset("cpu") == {}
    gpu, tpu = P.xla_flag_preset("cuda")["XLA_FLAGS"].split(), P.xla_flag_preset("tpu")["LIBTPU_INIT_ARGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in gpu
    assert "--xla_gpu_enable_while_loop_double_buffering=true" in gpu
    assert "--xla_tpu_enable_async_collective_fusion=true" in tpu
    assert not any("fuse_all_gather" in f for f in tpu)  # refused by newer libtpu outside v5e
    for flags in (gpu, tpu):
        assert len(flags) == len({f.split("=")[0] for f in flags}) and all(f.startswith("--xla_") for f in flags)


def test_preset_fills_only_what_the_user_left_unset():
    env = {}
    assert P.apply_xla_flag_preset("gpu", env) == env == P.xla_flag_preset("gpu")
    theirs = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert P.apply_xla_flag_preset("gpu", theirs) == {} and theirs == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    off = {"MESHLM_XLA_PRESET": "0"}
    assert P.apply_xla_flag_preset("tpu", off) == {} and "LIBTPU_INIT_ARGS" not in off
    cpu = {}
    assert P.apply_xla_flag_preset("cpu", cpu) == {} and cpu == {}


START = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"


def test_gpu_preset_is_accepted_by_xla():
    """jaxlib's XLA parses XLA_FLAGS (GPU flags included) when a backend starts and aborts on an unknown
    flag or value: the CPU backend starting with the GPU preset proves each name and value."""
    flags = P.xla_flag_preset("gpu")["XLA_FLAGS"]
    good = python(START, XLA_FLAGS=flags)
    assert good.returncode == 0 and "4.0" in good.stdout, good.stderr[-2000:]
    bad = python(START, XLA_FLAGS=flags + " --xla_gpu_no_such_flag=true")
    assert bad.returncode != 0 and "xla_gpu_no_such_flag" in bad.stderr


TPU_COMPILE = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps
    for name in ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"):
        devices = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
        mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("dp", "fsdp"))
        w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, Ps("fsdp")))
        x = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=NamedSharding(mesh, Ps(("dp", "fsdp"))))
        loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w)
        text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
        print(name, "all-gather" in text and "all-reduce" in text)
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the tpu extra)")
def test_tpu_preset_is_accepted_by_libtpu():
    """libtpu reads LIBTPU_INIT_ARGS when it loads, also to compile for a topology on this CPU machine,
    and aborts on an unknown flag: an fsdp step compiles with the preset for four TPU generations,
    and fails with a bogus flag."""
    flags = P.xla_flag_preset("tpu")["LIBTPU_INIT_ARGS"]
    good = python(TPU_COMPILE, LIBTPU_INIT_ARGS=flags)
    assert good.returncode == 0 and good.stdout.split().count("True") == 4, good.stderr[-2000:]
    bad = python(TPU_COMPILE, LIBTPU_INIT_ARGS=flags + " --xla_tpu_no_such_flag=true")
    assert bad.returncode != 0 and "xla_tpu_no_such_flag" in bad.stderr


# ------------------------------------------------------------------------------------ compilation cache

CACHED = """
    from meshlm.platform import configure_runtime
    configure_runtime()
    from jax._src import xla_bridge
    assert not xla_bridge.backends_are_initialized(), "configure_runtime started JAX"
    import jax, jax.numpy as jnp
    hits = []
    jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event))
    jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
    print(jax.config.jax_compilation_cache_dir, hits.count("/jax/compilation_cache/cache_hits"))
"""


def test_compilation_cache_is_shared_by_fresh_processes(tmp_path):
    env = {"MESHLM_CACHE": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = python(CACHED, **env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.split() == [str(tmp_path / "jax"), "0"]  # nothing to find yet
    assert any((tmp_path / "jax").iterdir())  # entries written
    second = python(CACHED, **env)
    folder, hits = second.stdout.split()
    assert second.returncode == 0 and folder == str(tmp_path / "jax") and int(hits) >= 1, second.stderr[-2000:]


def test_a_cache_folder_the_user_named_is_kept(tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir  # the test session's own (tests/conftest.py)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))  # as JAX_COMPILATION_CACHE_DIR does
    try:
        assert P.enable_compilation_cache({"MESHLM_CACHE": str(tmp_path)}) == str(tmp_path / "theirs")
        assert not (tmp_path / "jax").exists()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_compilation_cache_folder_and_switch(tmp_path):
    assert P.compilation_cache_dir({"MESHLM_CACHE": str(tmp_path)}) == tmp_path / "jax"
    assert P.compilation_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "meshlm" / "jax"
    assert P.compilation_cache_dir({"MESHLM_CACHE": str(tmp_path), "MESHLM_COMPILATION_CACHE": "0"}) is None


# ------------------------------------------------------------------------------------ memory budget


@pytest.mark.parametrize(
    "env,fraction",
    [
        ({}, 0.75),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}, 0.9),
        ({"XLA_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 0.5),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, 1.0),
    ],
)
def test_gpu_memory_fraction_is_what_jax_takes(env, fraction):
    assert P.gpu_memory_fraction(env)[0] == fraction


@pytest.mark.parametrize(
    "env,words",
    [
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"}, "give a fraction of device memory in (0, 1]"),
        ({"XLA_CLIENT_MEM_FRACTION": "most"}, "XLA_CLIENT_MEM_FRACTION=most"),
        (
            {"XLA_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"},
            "unset XLA_PYTHON_CLIENT_MEM_FRACTION",
        ),
    ],
)
def test_bad_memory_fraction_is_one_line(env, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        P.gpu_memory_fraction(env)


def test_planner_budgets_the_memory_jax_takes(monkeypatch):
    for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(var, raising=False)
    h100 = resolve_hardware("h100", 8)
    assert h100.hbm_bytes == pytest.approx(0.75 * 80e9) and h100.memory_fraction == 0.75
    assert h100.memory_note == "75% of 80 GB (JAX's default GPU memory fraction)"
    assert "memory: 75%" in h100.source
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert resolve_hardware("h100", 8, devices_per_host=4).hbm_bytes == pytest.approx(72e9)
    v5p = resolve_hardware("tpu-v5p", 4)
    assert v5p.hbm_bytes == 95e9 and v5p.memory_note == ""  # a TPU's HBM is JAX's


# ------------------------------------------------------------------------------------ precision


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--param_dtype=bfloat16"], "--dtype=bfloat16 --param_dtype=float32"),
        (["--dtype=float16"], "trains without loss scaling"),
    ],
)
@pytest.mark.parametrize("command", ["train", "explain", "plan"])
def test_training_formats_that_go_wrong_are_refused(capsys, command, flags, words):
    extra = (
        ["--steps=1", "--dataset=synthetic"] if command == "train" else ["--hardware=h100"] if command == "plan" else []
    )
    assert main([command, "--model=test", *extra, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and words in err, err


def test_serving_keeps_float16():
    from meshlm.job import resolve_serving
    from meshlm.models.presets import resolve_model

    job = resolve_serving(resolve_model("test"), mesh_dim="1,1,-1,1", dtype="float16", build=False)
    assert job.policy.dtype == job.policy.param_dtype == "float16"


def test_simulated_device_flags_replace_the_count_and_keep_the_rest():
    flags = P.simulated_device_flags("--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/x", 8).split()
    assert flags == ["--xla_dump_to=/tmp/x", "--xla_force_host_platform_device_count=8"]


AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_pipelined_steps_on_cpu_compile_with_the_default_scheduler():
    """The concurrency-optimised scheduler deadlocked a pp=4 × fsdp=2 step (two devices ran an
    all-gather and a collective-permute in opposite orders); other backends keep their defaults."""
    options = P.compiler_options("cpu", pipelined=True, cpuinfo=AVX2, environ={})
    assert options == {"xla_cpu_enable_concurrency_optimized_scheduler": False}
    assert P.compiler_options("cpu", cpuinfo=AVX2, environ={}) is None
    for backend in ("gpu", "tpu"):
        assert P.compiler_options(backend, pipelined=True, cpuinfo=AVX512, environ={}) is None


def test_cpu_programs_use_wide_vectors_where_the_cpu_has_avx512():
    wide = {"xla_cpu_prefer_vector_width": 512}
    assert P.compiler_options("cpu", cpuinfo=AVX512, environ={}) == wide
    assert P.compiler_options("cpu", pipelined=True, cpuinfo=AVX512, environ={}) == {
        **wide,
        "xla_cpu_enable_concurrency_optimized_scheduler": False,
    }
    # The user's own width, or the presets turned off, win.
    assert P.compiler_options("cpu", cpuinfo=AVX512, environ={"XLA_FLAGS": "--xla_cpu_prefer_vector_width=256"}) is None
    assert P.compiler_options("cpu", cpuinfo=AVX512, environ={"MESHLM_XLA_PRESET": "0"}) is None


def test_cpu_program_options_are_ones_this_xla_takes():
    """An option XLA does not know fails the compile ("No such compile option"): compile with all of them."""
    import jax
    import jax.numpy as jnp

    options = {**P.WIDE_VECTOR_CPU_COMPILER_OPTIONS, **P.PIPELINE_CPU_COMPILER_OPTIONS}
    f = jax.jit(lambda x: jnp.exp(x) * 2.0, compiler_options=options)
    assert float(f(jnp.zeros(()))) == 2.0


@pytest.mark.parametrize(
    "flags, fast",
    [
        ("fpu sse2 avx512f avx512_bf16 amx_tile", True),  # x86 with AVX512-BF16 (and AMX)
        ("fpu sse2 avx2 fma", False),  # x86 without: bf16 would be emulated
    ],
)
def test_auto_dtype_is_bf16_where_cpu_matmuls_are_fast(monkeypatch, flags, fast):
    """`auto`: bfloat16 on accelerators; on CPU for training only where the CPU has bf16 matmul
    instructions (Arm lists them under Features); serving on CPU keeps float32 weights."""
    from meshlm import platform

    assert platform.cpu_multiplies_bf16(f"processor\t: 0\nflags\t\t: {flags}\n") is fast
    assert platform.cpu_multiplies_bf16("Features\t: fp asimd bf16 i8mm\n") is True
    monkeypatch.setattr(platform, "cpu_multiplies_bf16", lambda cpuinfo=None: fast)
    assert platform.resolve_dtype("auto", "cpu") == ("bfloat16" if fast else "float32")
    assert platform.resolve_dtype("auto", "cpu", serving=True) == "float32"
    assert platform.resolve_dtype("auto", "gpu") == platform.resolve_dtype("auto", "tpu", serving=True) == "bfloat16"
    assert platform.resolve_dtype("float32", "gpu") == "float32"


def test_the_allocator_is_left_alone_where_the_user_tuned_it():
    assert not P.allocator_left_alone({})
    assert P.allocator_left_alone({"MALLOC_ARENA_MAX": "2"})
    assert P.allocator_left_alone({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert P.allocator_left_alone({"MESHLM_HOST_ALLOCATOR": "0"})
    assert not P.allocator_left_alone({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"})


_FAULTS_OF_A_FRESH_BLOCK = """
import ctypes, resource, sys
from meshlm import platform
kept = platform.keep_host_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 48 << 20  # over glibc's mmap threshold (at most 32 MiB), within one kept block

def fill_a_fresh_block():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)

fill_a_fresh_block()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill_a_fresh_block()  # the same again: page faults only where the memory went back to the kernel
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_kept_host_memory_is_not_faulted_in_again():
    """What a CPU step's scratch meets each run: a block freed and allocated again. By default glibc
    unmaps it and the second one faults all 12,288 pages in again; kept, it is served from the heap."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.pop("MESHLM_HOST_ALLOCATOR", None)
    runs = {}
    for mode in ("default", "keep"):
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS_OF_A_FRESH_BLOCK, mode], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        runs[mode] = (out[0] == "True", int(out[1]))
    assert runs["keep"][0] is True
    assert runs["default"][1] > 10_000 and runs["keep"][1] < 100, runs
