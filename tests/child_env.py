"""The environment of a run a test starts as a subprocess."""

from __future__ import annotations

import os

from bapo_jax.sharding.mesh import xla_flags_with_cpu_devices


def child_env(devices: int = 1, **changes: str) -> dict[str, str]:
    """`os.environ` for a child run on the CPU with `devices` simulated devices (1: as a user's
    run) and the suite's compile flags (tests/conftest.py: programs compiled alike compute
    alike)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **changes}
    env["XLA_FLAGS"] = xla_flags_with_cpu_devices(env.get("XLA_FLAGS", ""), devices)
    return env
