"""Every test here runs the CPU kernels: skip without a C++ compiler, fail if they do not build."""

import shutil
import sys

import pytest

from bapo_jax.kernels import library


@pytest.fixture(autouse=True)
def cpu_kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the kernels")
    assert sys.platform.startswith("linux")
    assert library.available(), "the kernels should build wherever a C++ compiler exists"
