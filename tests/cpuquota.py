"""Hold a process group to a share of one core with a cgroup CPU quota, for a test.

The kernel enforces the quota, whatever the scheduler does with the test's own processes:
a CPU vLLM server held to 10% of a core writes its tokens ten times slower, as a GPU
server writes a long stream over seconds, and a fault timed on the first token the client
reads lands mid-stream even when the client reads a second late. cgroup v2 (`cpu.max`)
or v1 (the `cpu` hierarchy's `cpu.cfs_quota_us`); `cpu_quota` yields False, holding
nothing, where neither can be written (not root, no cpu controller).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cpu_quota", "group_members", "group_states"]

_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


def group_states(pgid: int) -> dict[int, str]:
    """pid → state letter (/proc/PID/stat) of every process in group `pgid`."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after ')': state, ppid, pgrp
            out[int(entry.name)] = fields[0]
    return out


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    return [pid for pid, state in group_states(pgid).items() if state != "Z"]


def _hierarchy() -> tuple[Path, Path] | None:
    """(the folder to make the group in, the folder to move its processes back to)."""
    if (_ROOT / "cgroup.controllers").exists():  # v2, unified
        own = Path("/proc/self/cgroup").read_text().strip().rpartition("::")[2].strip("/")
        home = _ROOT / own
        # Beside this process's own group (a group with processes may not have children
        # with controllers), or under the root, which may.
        base = home.parent if own else home
        if "cpu" not in (base / "cgroup.subtree_control").read_text().split():
            return None
        return base, home
    if (_ROOT / "cpu" / "cgroup.procs").exists():  # v1
        return _ROOT / "cpu", _ROOT / "cpu"
    return None


def _hold(pgid: int, share: float, group: Path) -> bool:
    """Make `group` with the quota and move the process group into it (False: cannot)."""
    try:
        group.mkdir()
    except OSError:
        return False
    quota = max(1000, int(_PERIOD_US * share))
    try:
        if (group / "cpu.max").exists():
            (group / "cpu.max").write_text(f"{quota} {_PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        for pid in group_members(pgid):
            with contextlib.suppress(ProcessLookupError):  # gone since the listing
                (group / "cgroup.procs").write_text(str(pid))
    except OSError:
        _release(group, None)
        return False
    return True


def _release(group: Path, home: Path | None) -> None:
    """Move what is left in `group` to `home` and remove `group`."""
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                if home is not None:
                    (home / "cgroup.procs").write_text(pid)
        group.rmdir()


@contextlib.contextmanager
def cpu_quota(pgid: int, share: float, name: str) -> Iterator[bool]:
    """Put every process of group `pgid` in a new cgroup allowed `share` of one core for
    the block; move those left back and remove the group after. Yields whether it holds."""
    where = _hierarchy()
    group = where[0] / f"ftctl-test-{name}-{os.getpid()}" if where else None
    if where is None or group is None or not _hold(pgid, share, group):
        yield False
        return
    try:
        yield True
    finally:
        _release(group, where[1])
