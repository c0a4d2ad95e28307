"""Fixtures of the KV tests: the native row-copy kernel, built here from the shipped source."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

from dynamo_ftctl.kv import native


@pytest.fixture(scope="session")
def row_kernel(tmp_path_factory: Any) -> native.RowKernel:
    """`_rowcopy.c` compiled the way the install hook compiles it, and loaded (the test
    skips, saying why, where no C compiler can build it)."""
    try:
        path = native.build(tmp_path_factory.mktemp("rowcopy") / "_rowcopy.so")
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no C compiler could build the row-copy kernel: {exc}")
    loaded = native.load(path)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="session")
def pool_kernel(row_kernel: native.RowKernel, tmp_path_factory: Any) -> native.RowKernel:
    """The same kernel loaded a second time (a copy of the file: its own globals) with its
    own worker pool instead of torch's OpenMP team."""
    path = tmp_path_factory.mktemp("rowcopy-pool") / "_rowcopy.so"
    shutil.copy(row_kernel.path, path)
    loaded = native.load(path, openmp=False)
    assert loaded is not None
    assert loaded.team == "pool"
    return loaded
