"""The environment of a run a test starts as a subprocess."""

from __future__ import annotations

import os


def child_env(devices: int | None = None, **changes: str) -> dict[str, str]:
    """`os.environ` for a child run on the CPU with the suite's compile flags (tests/conftest.py:
    programs compiled alike compute alike) and `devices` simulated devices; None: one device,
    as a user's run."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **changes}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env
