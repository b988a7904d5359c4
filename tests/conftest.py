"""Test-wide setup: an 8-device simulated CPU mesh and float32 everywhere.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are cached on disk (keyed by the program, its options and the JAX version,
# so an entry is never stale) and shared with every subprocess a test starts: many tests, and
# the reference, killed and resumed runs of the resume tests, compile the same small programs.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax"),
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2**30))  # least recently used out
