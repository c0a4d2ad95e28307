"""Process groups a test run starts end with it, however the run ends.

A fixture stops the servers it started (vLLM, Dynamo) at teardown, but a test process
killed outright (SIGKILL, an OOM kill, a CI timeout's second signal) runs no teardown,
and each server leads a process group of its own (so that a test can kill its engine
core and workers with it), which no terminal or `timeout` signal reaches. So every such
group is also told to a watchdog: one small process per test process, in a session of
its own, that holds the read end of a pipe whose write end only the test process has.
When the test process ends, however it ends, the pipe reads EOF and the watchdog sends
SIGTERM to each group still registered, then SIGKILL to what is left after
`GRACE_S`. A group its owner stopped is unregistered (`forget`) first, so a process
group id the kernel hands out again is never signalled.

`popen_group(argv, ...)` starts a process in a new session and registers it;
`forget(pgid)` after stopping it. `interrupt_on_sigterm()` (the suite's conftest calls
it) makes SIGTERM to a test process a KeyboardInterrupt, as Ctrl-C is: pytest then runs
every fixture's teardown instead of dying at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from dynamo_ftctl import procfs

__all__ = ["GRACE_S", "forget", "group_alive", "group_running", "interrupt_on_sigterm",
           "popen_group", "process_exists", "watch", "watched"]

# From SIGTERM to SIGKILL, once the test process is gone (the variable: for its own test).
GRACE_S = float(os.environ.get("FTCTL_TEST_REAPER_GRACE_S", "10"))

def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is left (zombies count until reaped)."""
    return _signalable(os.killpg, pgid)


def group_running(pgid: int) -> bool:
    """Whether any process of group `pgid` is left that is not a zombie (Linux: read from
    /proc). A zombie whose parent died waits for init to reap it, which may take a while."""
    if not group_alive(pgid):
        return False
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = procfs.stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and _pgrp(int(entry.name)) == pgid:
                return True
    return False


def _pgrp(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def process_exists(pid: int) -> bool:
    """Whether process `pid` exists (a zombie too)."""
    return _signalable(os.kill, pid)


def _signalable(kill: Any, target: int) -> bool:
    try:
        kill(target, 0)
    except ProcessLookupError:
        return False
    return True


_WATCHDOG = r"""
import os, signal, sys, time
groups = set()
for line in sys.stdin:
    sign, pgid = line[0], int(line[1:])
    (groups.add if sign == "+" else groups.discard)(pgid)
def alive(pgid):
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
def send(sig):
    for pgid in [g for g in groups if alive(g)]:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
send(signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[1])
while any(alive(g) for g in groups) and time.monotonic() < deadline:
    time.sleep(0.05)
send(signal.SIGKILL)
"""

class _Watchdog:
    """This process's watchdog, started on first use (a forked child starts its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.owner = 0  # the pid whose watchdog it is
        self.watched: set[int] = set()

    def send(self, line: str) -> None:
        with self.lock:
            if self.proc is None or self.owner != os.getpid():
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _WATCHDOG, str(GRACE_S)], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, text=True, start_new_session=True)
                self.owner = os.getpid()
                self.watched.clear()
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()


_DOG = _Watchdog()


def watch(pgid: int) -> None:
    """Have the process group `pgid` killed when this process ends, unless forgotten."""
    _DOG.send(f"+{pgid}")
    _DOG.watched.add(pgid)


def forget(pgid: int) -> None:
    """The group `pgid` was stopped by its owner: the watchdog no longer signals it."""
    if pgid in _DOG.watched and _DOG.owner == os.getpid():
        _DOG.send(f"-{pgid}")
        _DOG.watched.discard(pgid)


def watched() -> frozenset[int]:
    """The groups this process has registered and not forgotten."""
    return frozenset(_DOG.watched) if _DOG.owner == os.getpid() else frozenset()


def popen_group(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **kwargs)` in a new session (a process group it leads),
    registered with the watchdog."""
    proc: subprocess.Popen[Any] = subprocess.Popen(argv, start_new_session=True, **kwargs)
    watch(proc.pid)
    return proc


def interrupt_on_sigterm() -> None:
    """SIGTERM to this process raises KeyboardInterrupt (main thread only, as signals)."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
