"""`run.cli.ensure_environment`: JAX's CPU platform and simulated devices are set in-process;
the process re-executes itself at most once, for glibc's allocator, and never with
`--no-reexec` (the escape for debuggers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex

from bapo_jax.malloc import MALLOC_TUNABLES
from bapo_jax.run.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(*args: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.run.env_probe", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    chex.assert_equal(proc.returncode, 0)
    lines = proc.stdout.strip().splitlines()
    chex.assert_equal(len(lines), 1)  # one process reports: the re-exec replaced the first
    return json.loads(lines[0]), proc.stderr


def test_devices_are_set_in_process_and_the_allocator_by_one_reexec():
    report, _ = _probe("4", "reexec")
    chex.assert_equal((report["devices"], report["platform"]), (4, "cpu"))
    chex.assert_equal(report["tunables"], MALLOC_TUNABLES)


def test_no_reexec_keeps_the_process_and_still_sets_the_devices():
    report, stderr = _probe("3", "no")
    chex.assert_equal((report["devices"], report["platform"]), (3, "cpu"))
    chex.assert_equal(report["tunables"], "")  # glibc's defaults: no re-exec happened
    assert "note: --no-reexec: glibc's default allocator" in stderr, stderr


def test_every_experiment_command_line_has_the_escape():
    args = build_parser("x").parse_args(["--dry-run", "--no-reexec"])
    assert args.no_reexec and args.dry_run
    chex.assert_equal(build_parser("x").parse_args([]).no_reexec, False)


def test_the_compilation_cache_is_under_the_run_unless_the_environment_names_one(tmp_path):
    import jax

    from bapo_jax.run.cli import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        path = compilation_cache(str(tmp_path / "run"), {})
        assert path == str(tmp_path / "run" / "jax_cache")
        assert jax.config.jax_compilation_cache_dir == path
        mine = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "shared")}
        assert compilation_cache(str(tmp_path / "run"), mine) == str(tmp_path / "shared")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
