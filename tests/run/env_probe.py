"""Run by tests/run/test_cli_environment.py: `python -m tests.run.env_probe N reexec|no`.

Sets the run environment as an experiment does (`cli.ensure_environment`, a dry run's CPU
platform with N simulated devices), then prints what this process ended up with as JSON."""

import json
import os
import sys

from bapo_jax.run import cli

cli.ensure_environment(
    int(sys.argv[1]),
    "tests.run.env_probe",
    sys.argv[1:],
    cpu_platform=True,
    reexec=sys.argv[2] == "reexec",
)
import jax  # noqa: E402  (after the environment, as in an experiment)

print(
    json.dumps(
        {
            "devices": jax.device_count(),
            "platform": jax.default_backend(),
            "tunables": os.environ.get("GLIBC_TUNABLES", ""),
        }
    )
)
