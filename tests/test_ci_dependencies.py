"""tests/conftest.py's CI hooks: with CI=true a `pytest.importorskip` of a module that will not
import fails (at module level: a collection error; in a test: a failed test), naming the module;
without CI it skips. Each case is a pytest child run on small test files, with the suite's
conftest loaded as a plugin (`-p tests.conftest`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE_LEVEL = """
    import pytest

    missing = pytest.importorskip("bapo_no_such_module")

    def test_never_runs():
        raise AssertionError("the module was collected without its dependency")
"""
IN_TESTS = """
    import sys

    import pytest

    def test_with_torch_missing(monkeypatch):
        monkeypatch.setitem(sys.modules, "torch", None)  # import torch: ModuleNotFoundError
        pytest.importorskip("torch")

    def test_skipped_for_another_reason():
        pytest.skip("not an import")

    def test_passes():
        pass
"""


def _pytest(tmp_path, source: str, ci: str | None) -> subprocess.CompletedProcess:
    """pytest on one test file with tests/conftest.py's hooks and CI=`ci` (None: unset)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's options
    (tmp_path / "test_case.py").write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no installed plugins: a quicker start
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if ci is not None:
        env["CI"] = ci
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    command += ["-rA", "-c", "pytest.ini", "test_case.py"]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def _summary(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.strip().splitlines()[-1]


def test_in_ci_a_module_level_importorskip_is_a_collection_error(tmp_path):
    proc = _pytest(tmp_path, MODULE_LEVEL, "true")
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, proc.stdout  # collection errors
    assert "1 error" in _summary(proc), proc.stdout
    assert "ERROR collecting test_case.py" in proc.stdout
    assert "CI=true: test dependency 'bapo_no_such_module' is missing" in proc.stdout
    assert "No module named 'bapo_no_such_module'" in proc.stdout
    assert "the module was collected" not in proc.stdout


def test_in_ci_an_importorskip_in_a_test_fails_it_and_other_skips_stay(tmp_path):
    proc = _pytest(tmp_path, IN_TESTS, "true")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    assert _summary(proc).startswith("=") and "1 failed, 1 passed, 1 skipped" in _summary(proc)
    assert "FAILED test_case.py::test_with_torch_missing" in proc.stdout
    assert "CI=true: test dependency 'torch' is missing" in proc.stdout
    assert "SKIPPED [1] test_case.py" in proc.stdout and "not an import" in proc.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_missing_import_skips(tmp_path, ci):
    proc = _pytest(tmp_path, MODULE_LEVEL, ci)
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout
    assert "1 skipped" in _summary(proc), proc.stdout
    assert "could not import 'bapo_no_such_module'" in proc.stdout
    proc = _pytest(tmp_path, IN_TESTS, ci)
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "1 passed, 2 skipped" in _summary(proc), proc.stdout
    assert "could not import 'torch'" in proc.stdout and "CI=true" not in proc.stdout
