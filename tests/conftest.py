"""Test-wide setup: an 8-device simulated CPU mesh, quick-to-compile XLA settings, float32.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time.

The tests compile hundreds of small programs and run each for milliseconds, so compiling is
most of the suite's time (about 70% of a cold run: XLA's backend compile ~54%, lowering to
MLIR ~12%, tracing ~5%). Three flags cut the backend's share:

    --xla_backend_optimization_level=0          LLVM at level 0: about 1.7x as fast
    --xla_cpu_use_fusion_emitters=false         XLA:CPU's loop emitters, not its MLIR fusion
                                                emitters (about half the backend compile again)
    --xla_cpu_parallel_codegen_split_count=1    one LLVM module a program: splitting it for
                                                parallel codegen costs more than it saves with
                                                a test process per core

Results agree with XLA's defaults' within float rounding (the compilers may order or fuse
floating-point operations differently), not to the bit, so every comparison in
the suite is against a reference with a tolerance or between programs compiled with the same
flags: a test's child runs get them from `tests.child_env`. The main job, the benchmarks and a
user's run keep XLA's default.

In CI (CI=true) a test that `pytest.importorskip`s a module that will not import fails instead of
skipping (the hooks at the end).
"""

import os
import re

import pytest

TEST_COMPILE_FLAGS = " ".join(
    (
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
    )
)

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


# ---- CI: a missing test dependency fails ------------------------------------------------------
# The HF parity, export and tracking tests `pytest.importorskip` torch, transformers and wandb, so
# that a trainer-only environment still runs the rest. CI installs the test extras
# (`pip install -e '.[test]'`): there (CI=true, as GitHub Actions and most CI services set it) a
# test skipped because a module would not import is a hole in the checks, so it fails instead,
# naming the module. A skip for any other reason stays a skip. (tensorboard, the other test-only
# reader, is imported outright: without it its modules fail to collect, in CI or not.)
_IMPORT_SKIP = re.compile(r"could not import '(?P<module>[\w.]+)'")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _skip_message(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The message of a skipped report (longrepr (path, line, message)), else None."""
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])
    return None


def _fail_missing_import(report: pytest.CollectReport | pytest.TestReport) -> None:
    """In CI, turn a skip by `pytest.importorskip` (its message "could not import 'name': ...")
    into a failure."""
    message = _skip_message(report)
    match = None if message is None else _IMPORT_SKIP.search(message)
    if match is None or not _in_ci():
        return
    report.outcome = "failed"
    reason = message.removeprefix("Skipped: ")
    report.longrepr = (
        f"CI=true: test dependency {match['module']!r} is missing ({reason}); in CI a missing "
        "test dependency fails instead of skipping: install the test extras "
        "(pip install -e '.[test]')"
    )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module-level `importorskip` skips the module's collection: in CI, a collection error."""
    report = yield
    _fail_missing_import(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """An `importorskip` in a test or a fixture skips its phase: in CI, a failure."""
    report = yield
    _fail_missing_import(report)
    return report
