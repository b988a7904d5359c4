"""The kernel library's build cache: its key covers every file the compiler reads from this
package (so an edited header rebuilds), and a failed build leaves no file behind."""

import re
import subprocess
from pathlib import Path

import chex
import pytest

from bapo_jax.kernels import library


def test_every_local_include_is_a_hashed_header():
    package = Path(library.__file__).parent
    local = set()
    for source in library.SOURCES + library.HEADERS:
        for name in re.findall(r'#include "([^"]+)"', source.read_text()):
            if (package / name).exists():
                local.add(package / name)
    assert local, "the kernels share work_sharing.h"
    assert local <= set(library.HEADERS), local - set(library.HEADERS)


def test_cache_key_changes_with_a_header(tmp_path, monkeypatch):
    before = library.library_path()
    edited = tmp_path / library.HEADERS[0].name
    edited.write_text(library.HEADERS[0].read_text() + "\n// edited\n")
    monkeypatch.setattr(library, "HEADERS", (edited, *library.HEADERS[1:]))
    after = library.library_path()
    assert after != before
    chex.assert_equal(after.parent, before.parent)


def test_failed_build_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(subprocess.CalledProcessError):
        library._build(tmp_path / "kernels" / "bapo_kernels-test.so")
    chex.assert_equal(list((tmp_path / "kernels").iterdir()), [])
