"""Attacks on an flock lock's files (issue 30, cases 1 and 2), shared by the lock tests and
`benchmarks/chaos.py` (`chaos_rows`).

- `plant(path, kind, victim)`: put a hostile file where ftctl opens the lock file or its
  floor (a symbolic link to a victim file or directory, a dangling link, a FIFO, a
  character device, a socket, a directory, a hard link to the victim);
- `overlap_run(folder, how)`: holder A runs a command that writes a timestamp every
  5 ms and ignores SIGTERM; the lock file (or both files) is deleted or replaced; B
  acquires and writes its own timestamp: A's last and B's first mark, and both tokens;
- `chaos_rows()`: one row (attack, expected, observed, ok) per attack, with the
  default settings.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.waiting import wait_until

if TYPE_CHECKING:
    import pytest

ROOT = Path(__file__).resolve().parents[3]
FTCTL = (sys.executable, "-m", "dynamo_ftctl")
KINDS = ("symlink to file", "symlink to dir", "dangling symlink", "FIFO", "char device",
         "socket", "directory", "hard link")
VICTIM_BYTES = b"the victim's own data\n"
# The pod-wide settings at their defaults (a stop bound of 0.5 + 5 + 0.5 = 6 s).
DEFAULTS = {"FTCTL_LOCK_WATCH_INTERVAL": "0.5", "FTCTL_LOCK_TERM_GRACE": "5"}


def short_stop_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 0.8 s stop bound (interval 0.1 s + grace 0.2 s + 0.5 s) for this test and the
    processes it starts."""
    monkeypatch.setenv("FTCTL_LOCK_WATCH_INTERVAL", "0.1")
    monkeypatch.setenv("FTCTL_LOCK_TERM_GRACE", "0.2")


@dataclass
class Victim:
    """A file and a folder outside the lock's directory that must come out untouched."""

    file: Path
    folder: Path

    @classmethod
    def make(cls, root: Path) -> Victim:
        outside = root / "elsewhere"
        outside.mkdir()
        (outside / "victim").write_bytes(VICTIM_BYTES)
        (outside / "dir").mkdir()
        return cls(outside / "victim", outside / "dir")

    def snapshot(self) -> tuple[bytes, list[str], list[str]]:
        """The victim's bytes and what lies beside it and in the victim folder."""
        return (self.file.read_bytes(), sorted(p.name for p in self.file.parent.iterdir()),
                sorted(p.name for p in self.folder.iterdir()))


def plant(path: Path, kind: str, victim: Victim) -> bool:
    """Put a `kind` (one of KINDS) at `path`; False when this machine cannot (no mknod)."""
    if kind == "symlink to file":
        path.symlink_to(victim.file)
    elif kind == "symlink to dir":
        path.symlink_to(victim.folder)
    elif kind == "dangling symlink":
        path.symlink_to(victim.file.with_name("not-there"))
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "char device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            return False
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
    elif kind == "directory":
        path.mkdir()
    elif kind == "hard link":
        os.link(victim.file, path)
    else:
        msg = f"unknown kind {kind!r}"
        raise ValueError(msg)
    return True


def acquire(path: Path, *command: str, env: dict[str, str] | None = None,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`ftctl lock acquire -p PATH -t 10 -- COMMAND` (default: print the token)."""
    argv = command or ("sh", "-c", "echo $FTCTL_LOCK_TOKEN")
    return subprocess.run([*FTCTL, "lock", "acquire", "-p", str(path), "-t", "10", "--",
                           *argv], capture_output=True, text=True, timeout=timeout_s,
                          check=False, cwd=ROOT, env={**os.environ, **(env or {})})


# The held command: its token, then a monotonic timestamp every 5 ms into argv[1] (O_APPEND,
# so each line is whole); "stubborn" ignores SIGTERM (the watcher's SIGKILL ends it).
MARKER = """
import os, signal, sys, time
out = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(out, b"token %s\\n" % os.environ["FTCTL_LOCK_TOKEN"].encode())
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        os.write(out, b"%.6f\\n" % time.monotonic())
        time.sleep(0.005)
else:
    os.write(out, b"%.6f\\n" % time.monotonic())
"""


@dataclass(frozen=True)
class Overlap:
    """What `overlap_run` saw: A's last and B's first mark (monotonic s), the tokens,
    and the seconds from the attack to B's first mark."""

    a_last: float
    b_first: float
    a_token: int
    b_token: int
    b_after_s: float

    @property
    def overlapped(self) -> bool:
        return self.b_first <= self.a_last


def _marks(path: Path) -> tuple[int, list[float]]:
    lines = path.read_text().splitlines()
    return int(lines[0].split()[1]), [float(line) for line in lines[1:]]


def overlap_run(folder: Path, how: str, env: dict[str, str] | None = None) -> Overlap:
    """Holder A (stubborn) holds `folder/P`; then `how`: "rm P", "rm P P.floor" or
    "mv over P"; B acquires and marks once. Returns A's and B's marks and tokens."""
    path, a_marks, b_marks = folder / "P", folder / "a.marks", folder / "b.marks"
    full_env = {**os.environ, **(env or {})}
    holder = subprocess.Popen([*FTCTL, "lock", "acquire", "-p", str(path), "--",
                               sys.executable, "-c", MARKER, str(a_marks), "stubborn"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=full_env)
    try:
        wait_until(lambda: a_marks.exists() and a_marks.read_text().count("\n") >= 3, 60,
                   "holder A's first marks")
        attacked = time.monotonic()
        if how == "mv over P":
            incoming = folder / "incoming"
            incoming.write_text('{"token": 1}\n')
            incoming.rename(path)
        else:
            path.unlink()
            if how == "rm P P.floor":
                folder.joinpath("P.floor").unlink()
        b = subprocess.run([*FTCTL, "lock", "acquire", "-p", str(path), "-t", "60", "--",
                            sys.executable, "-c", MARKER, str(b_marks), "once"],
                           capture_output=True, text=True, timeout=120, check=False,
                           cwd=ROOT, env=full_env)
        if b.returncode != 0:
            msg = f"B failed: exit {b.returncode}: {b.stderr.strip()}"
            raise RuntimeError(msg)
        holder.wait(60)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate(timeout=30)
    a_token, a = _marks(a_marks)
    b_token, bm = _marks(b_marks)
    return Overlap(a_last=max(a), b_first=min(bm), a_token=a_token, b_token=b_token,
                   b_after_s=min(bm) - attacked)


def refused_row(where: str) -> tuple[str, str, str, bool]:
    """A symbolic link to a victim at P (`where` "P") or at P.floor ("P.floor")."""
    with tempfile.TemporaryDirectory(prefix="ftctl-lock-attack-") as folder:
        root = Path(folder)
        victim = Victim.make(root)
        lock_dir = root / "locks"
        lock_dir.mkdir()
        before = victim.snapshot()
        plant(lock_dir / where, "symlink to file", victim)
        proc = acquire(lock_dir / "P", "true")
        after = victim.snapshot()
        created = sorted(set(after[1]) - set(before[1]))
        same = after[0] == before[0]
        ok = proc.returncode == 2 and same and not created and proc.stderr.count("\n") == 1
        observed = (f"exit {proc.returncode}, victim {'unchanged' if same else 'CHANGED'}, "
                    f"created beside it: {created or 'nothing'}")
        return (f"symlink at {where} to a victim file", "exit 2 (one line), victim "
                "byte-identical, nothing created beside it", observed, ok)


def overlap_row(how: str, env: dict[str, str] | None = None) -> tuple[str, str, str, bool]:
    """`how` ("rm P", "rm P P.floor") while A holds the lock, then B acquires."""
    with tempfile.TemporaryDirectory(prefix="ftctl-lock-attack-") as folder:
        run = overlap_run(Path(folder), how, env)
    gap_ms = (run.b_first - run.a_last) * 1000
    ok = not run.overlapped and run.b_token > run.a_token
    observed = (f"A's last mark {gap_ms:.0f} ms before B's first ({run.b_after_s:.2f} s after "
                f"the {how}); tokens {run.a_token} -> {run.b_token}")
    return (f"{how} while A holds (A ignores SIGTERM)", "one holder at a time: A's last mark "
            "before B's first; B's token higher", observed, ok)


def chaos_rows() -> list[tuple[str, str, str, bool]]:
    """(attack, expected, observed, ok) for issue 30's lock cases, with default settings:
    symlink at P, symlink at P.floor, rm P while held, rm P P.floor while held."""
    return [refused_row("P"), refused_row("P.floor"), overlap_row("rm P", DEFAULTS),
            overlap_row("rm P P.floor", DEFAULTS)]


if __name__ == "__main__":
    for attack, expected, observed, ok in chaos_rows():
        print(f"{'OK ' if ok else 'BAD'} {attack}\n    expected: {expected}\n"
              f"    observed: {observed}")
