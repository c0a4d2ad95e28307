"""Fixtures of the KV tests: the native row-copy kernel, built here from the shipped source."""

from __future__ import annotations

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
