"""Fixtures of the load generator's integration tests: the loopback target in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

StartTarget = Callable[..., str]


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The process's first stdout line, or '' after `timeout` seconds."""
    box: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


@pytest.fixture
def start_target() -> Iterator[StartTarget]:
    """Start `python -m dynamo_ftctl.loadgen.target ARGS` on a free port; yield its URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl.loadgen.target", "--port", "0", *args],
            stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = _read_line(proc, timeout=20)
        match = re.search(r"listening on (\S+):(\d+)", line)
        assert match, f"target did not start: {line!r}"
        return f"http://{match.group(1)}:{match.group(2)}"

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
