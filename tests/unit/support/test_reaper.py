"""`tests/reaper.py`: the process groups a test process started end with it, however it
ends; a group its owner forgot is left alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reaper import group_alive, group_running
from tests.waiting import wait_until

ROOT = Path(__file__).parents[3]

# An owner process: starts the groups it is told to, registers them (forgetting those
# marked "forget"), prints their ids, then waits for its end (a signal or "exit").
OWNER = r"""
import os, subprocess, sys
from tests import reaper
pgids = []
for spec in sys.argv[1:]:
    how, shell = spec.split(":", 1)
    proc = reaper.popen_group(["sh", "-c", shell], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL)
    if how == "forget":
        reaper.forget(proc.pid)
    pgids.append(proc.pid)
assert reaper.watched() == {p for p, s in zip(pgids, sys.argv[1:]) if s.startswith("keep")}
print(" ".join(map(str, pgids)), flush=True)
sys.stdin.readline()
"""

TWO_SLEEPERS = "sleep 600 & sleep 600; wait"
STUBBORN = "trap '' TERM; sleep 600 & sleep 600; wait"


@contextlib.contextmanager
def _owner(*specs: str) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FTCTL_TEST_REAPER_GRACE_S": "0.5"}
    pgids: list[int] = []
    with subprocess.Popen([sys.executable, "-c", OWNER, *specs], cwd=ROOT, env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, f"the owner failed (exit {proc.wait(30)})"
            pgids = [int(p) for p in line.split()]
            for pgid in pgids:
                wait_until(lambda pgid=pgid: group_alive(pgid), 10.0, f"group {pgid} up")
            yield proc, pgids
        finally:
            proc.kill()
            proc.wait(30)
            for pgid in pgids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)


@pytest.mark.parametrize("end", ["SIGKILL", "SIGTERM", "exit"])
def test_groups_end_with_the_process_that_started_them(end: str) -> None:
    """However the owner ends, its groups go: those that take SIGTERM at once, one that
    ignores it by SIGKILL after the grace."""
    with _owner(f"keep:{TWO_SLEEPERS}", f"keep:{STUBBORN}") as (proc, pgids):
        if end == "exit":
            assert proc.stdin is not None
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        else:
            proc.send_signal(getattr(signal, end))
        proc.wait(30)
        wait_until(lambda: not any(map(group_alive, pgids)), 30.0, "every group gone",
                   accept=bool)


def test_a_forgotten_group_is_left_alone() -> None:
    """A group its owner stopped (and forgot) is not signalled: its id may be another's."""
    with _owner(f"forget:{TWO_SLEEPERS}", f"keep:{TWO_SLEEPERS}") as (proc, pgids):
        forgotten, kept = pgids
        proc.kill()
        proc.wait(30)
        wait_until(lambda: not group_alive(kept), 30.0, "the kept group gone")
        assert group_alive(forgotten)


def test_a_group_left_with_a_zombie_is_not_running() -> None:
    """group_running holds while a process of the group runs, and not once its only one
    left is a zombie (that group_alive still counts)."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert group_running(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        wait_until(lambda: not group_running(proc.pid), 10.0, "only a zombie left")
        assert group_alive(proc.pid)  # not reaped yet
    finally:
        proc.kill()
        proc.wait()
    assert not group_running(proc.pid)


CONFTEST = """
from tests.reaper import interrupt_on_sigterm

def pytest_configure(config):
    interrupt_on_sigterm()
"""

SLOW_TEST = """
import os, subprocess, time
from pathlib import Path

import pytest

from tests import reaper

OUT = Path(os.environ["REAPER_OUT"])

@pytest.fixture
def server():
    proc = reaper.popen_group(["sleep", "600"])
    (OUT / "pgid").write_text(str(proc.pid))
    yield proc
    proc.kill()
    proc.wait()
    reaper.forget(proc.pid)
    (OUT / "torn-down").write_text("yes")

def test_waits(server):
    (OUT / "running").write_text("yes")
    time.sleep(600)  # the run is stopped from outside
"""


def test_sigterm_to_a_test_run_runs_its_teardown(tmp_path: Path) -> None:
    """A test run stopped by SIGTERM (a CI timeout) tears its fixtures down, as after
    Ctrl-C, and what they started is gone."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_slow.py").write_text(SLOW_TEST)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REAPER_OUT": str(tmp_path)}
    pgid = 0
    with subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "--rootdir", str(suite), str(suite)],
                          cwd=suite, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as run:
        try:
            wait_until((tmp_path / "running").exists, 60.0, "the test running")
            pgid = int((tmp_path / "pgid").read_text())
            run.send_signal(signal.SIGTERM)
            out, _ = run.communicate(timeout=60)
            assert (tmp_path / "torn-down").exists(), out.decode(errors="replace")[-2000:]
            assert not group_alive(pgid)
        finally:
            run.kill()
            if pgid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
