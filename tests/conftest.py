"""Test-wide setup: an 8-device simulated CPU mesh and float32 everywhere.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
