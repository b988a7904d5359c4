"""Test-wide setup: an 8-device simulated CPU mesh, LLVM at optimisation level 0, float32.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time.

The tests compile hundreds of small programs and run each for milliseconds, so compiling is
most of the suite's time, and most of compiling is LLVM optimising machine code: level 0 makes
it about 1.7x as fast. Results agree with the default level's within float rounding (LLVM may
order or fuse floating-point operations differently), not to the bit, so every comparison in
the suite is against a reference with a tolerance or between programs compiled with the same
flags: a test's child runs get them from `tests.child_env`. The main job, the benchmarks and a
user's run keep XLA's default.
"""

import os

TEST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"

os.environ["XLA_FLAGS"] = " ".join(
    (
        os.environ.get("XLA_FLAGS", ""),
        TEST_COMPILE_FLAGS,
        "--xla_force_host_platform_device_count=8",
    )
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
