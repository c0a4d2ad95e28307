"""The lock file and its floor are opened only as regular files of one name (issue 30, case 1):
a symbolic link, FIFO, device, socket, directory or hard link planted at P or P.floor is
refused with one line (exit 2), and whatever it points to is left byte-identical."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl.errors import LeaseLost, OutputRefused
from dynamo_ftctl.lock import FlockLock
from tests.integration.lock.hostile_files import FTCTL, KINDS, ROOT, Victim, acquire, plant
from tests.waiting import wait_until

# What each kind is called in the one-line refusal.
SAID = {"symlink to file": "a symbolic link", "symlink to dir": "a symbolic link",
        "dangling symlink": "a symbolic link", "FIFO": "a FIFO",
        "char device": "a character device", "socket": "a socket",
        "directory": "a directory", "hard link": "2 hard links"}


@pytest.fixture
def victim(tmp_path: Path) -> Victim:
    return Victim.make(tmp_path)


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    folder.mkdir()
    return folder


def planted(path: Path, kind: str, victim: Victim) -> None:
    if not plant(path, kind, victim):
        pytest.skip(f"cannot make a {kind} here (mknod needs CAP_MKNOD)")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["P", "P.floor"])
def test_acquire_refuses_a_hostile_file_and_leaves_the_victim_alone(
        where: str, kind: str, victim: Victim, lock_dir: Path) -> None:
    """`lock acquire -p P -- CMD` with `kind` at P or P.floor: exit 2, one line naming the
    file and what it is, CMD never runs, the victim byte-identical and nothing beside it."""
    before = victim.snapshot()
    planted(lock_dir / where, kind, victim)
    proc = acquire(lock_dir / "P", "sh", "-c", "echo ran", timeout_s=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"{lock_dir / where}: " in proc.stderr
    assert SAID[kind] in proc.stderr
    assert "ran" not in proc.stdout
    assert victim.snapshot() == before
    assert not victim.file.with_name("not-there").exists()  # a dangling link is not followed


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "hard link"])  # (read, not written)
def test_status_refuses_a_hostile_lock_file(kind: str, victim: Victim, lock_dir: Path) -> None:
    """`lock status -p P` with `kind` at P: exit 2 and one line, without blocking on a FIFO."""
    planted(lock_dir / "P", kind, victim)
    proc = subprocess.run([*FTCTL, "lock", "status", "-p", str(lock_dir / "P")],
                          capture_output=True, text=True, timeout=30, check=False, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert SAID[kind] in proc.stderr


@pytest.mark.parametrize("kind", ["symlink to file", "hard link"])
def test_fd_form_refuses_a_hostile_floor_or_hard_link(kind: str, victim: Victim,
                                                      lock_dir: Path) -> None:
    """`exec 9<>P; lock acquire --fd 9` with a link at P.floor, or with P a hard link of the
    victim: exit 2, the victim untouched (the descriptor's owner data is not written)."""
    path = lock_dir / "P"
    if kind == "hard link":
        planted(path, kind, victim)
    else:
        planted(lock_dir / "P.floor", kind, victim)
    before = victim.snapshot()
    script = f"exec 9<>{path}\n{sys.executable} -m dynamo_ftctl lock acquire --fd 9\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert SAID[kind] in proc.stderr
    assert victim.snapshot() == before


def test_symlink_swapped_in_while_waiting_is_refused(victim: Victim, lock_dir: Path) -> None:
    """A waiter whose lock file is replaced by a symbolic link to the very inode it waits on
    does not take the link for the file (lstat): it reopens the path and refuses it."""
    path = lock_dir / "P"
    holder = FlockLock(path, watch_interval_s=0)
    holder.acquire(5)
    waiter = FlockLock(path, engine_id=1, watch_interval_s=0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.acquire(10)
        except BaseException as exc:  # (the test inspects it)
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    inode = path.stat().st_ino
    wait_until(lambda: any("->" in line and f":{inode} " in line
                           for line in Path("/proc/locks").read_text().splitlines()),
               10, "the waiter blocked in flock (/proc/locks)", interval=0.005)
    os.link(path, lock_dir / "other-name")  # the inode's name once P is the link
    (lock_dir / "link").symlink_to(lock_dir / "other-name")
    (lock_dir / "link").rename(path)
    holder.release()
    thread.join(15)
    assert len(errors) == 1
    assert isinstance(errors[0], OutputRefused)
    assert "a symbolic link" in str(errors[0])
    assert not waiter.is_held


def test_holder_sees_its_file_swapped_for_a_symlink_to_it(lock_dir: Path) -> None:
    """A symbolic link to the locked inode put at P is a replacement (lstat, not stat): the
    next acquirer could not lock through it, so the holder is told."""
    path = lock_dir / "P"
    lock = FlockLock(path, watch_interval_s=0)
    lock.acquire(5)
    os.link(path, lock_dir / "other-name")
    (lock_dir / "link").symlink_to(lock_dir / "other-name")
    (lock_dir / "link").rename(path)
    with pytest.raises(LeaseLost, match="replaced by another file"):
        lock.ensure_held()
    lock.release()


# P and P.floor each: absent, a regular file, or a hostile kind (no device: mknod may be
# refused; the parametrized matrix covers it).
STATES = ["absent", "regular", *(k for k in KINDS if k != "char device")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(at_lock=st.sampled_from(STATES), at_floor=st.sampled_from(STATES))
def test_any_pair_of_files_is_taken_only_when_both_are_plain(at_lock: str,
                                                             at_floor: str) -> None:
    """For every pair of states of P and P.floor, `FlockLock.acquire` succeeds exactly when
    both are absent or single-named regular files, else raises `OutputRefused`; the victim
    comes out byte-identical either way."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        victim = Victim.make(root)
        lock_dir = root / "locks"
        lock_dir.mkdir()
        for name, state in (("P", at_lock), ("P.floor", at_floor)):
            if state == "regular":
                (lock_dir / name).write_text("")
            elif state != "absent":
                plant(lock_dir / name, state, victim)
        before = victim.snapshot()
        lock = FlockLock(lock_dir / "P", watch_interval_s=0, settle_s=0)
        plain = {at_lock, at_floor} <= {"absent", "regular"}
        if plain:
            assert lock.acquire(5).token > 0
            lock.release()
        else:
            with pytest.raises(OutputRefused):
                lock.acquire(5)
            assert not lock.is_held
        assert victim.snapshot() == before
