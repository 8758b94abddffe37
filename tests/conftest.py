"""Every test runs on 8 simulated CPU devices; the flag must be set before JAX is imported."""

import os

from meshlm.platform import simulated_device_flags  # imports no JAX

os.environ["XLA_FLAGS"] = simulated_device_flags(os.environ.get("XLA_FLAGS", ""), 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
