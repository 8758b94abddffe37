"""Every test runs on 8 simulated CPU devices; the flag must be set before JAX is imported.

A `pytest` run shares one persistent compilation cache between its tests (and its xdist workers): a
fresh folder made for the run and removed after it, so a program that one test compiled (an
initialiser, a train step, a decode step, ...) is loaded rather than compiled again when another test
builds the very same program (JAX keys entries by the program, the compile options and the devices).
Nothing carries over between runs. MESHLM_TEST_COMPILATION_CACHE=0 turns it off; a folder named there
is used (and kept) instead of a fresh one.
"""

import os
import shutil
import tempfile

from meshlm.platform import OFF, simulated_device_flags  # imports no JAX

os.environ["XLA_FLAGS"] = simulated_device_flags(os.environ.get("XLA_FLAGS", ""), 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CACHE_VAR = "MESHLM_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    # The controller (or a run without xdist) makes the folder; workers inherit the variable.
    if not hasattr(config, "workerinput") and CACHE_VAR not in os.environ:
        os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix="meshlm-test-compilation-cache-")
        config.meshlm_made_cache = os.environ[CACHE_VAR]
    folder = os.environ[CACHE_VAR]
    if folder.strip().lower() not in OFF:
        import jax  # starts no backend

        jax.config.update("jax_compilation_cache_dir", folder)


def pytest_unconfigure(config):
    folder = getattr(config, "meshlm_made_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(CACHE_VAR, None)
