"""The stop bound's other side (issue 30, case 2): a lock file the token floor has not seen
(new, or replacing the file of the last token) is held for the bound before its token is
issued, once; a file the floor knows is taken at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.lock import FlockLock
from dynamo_ftctl.lock.bound import stop_bound_s, term_grace_from_env
from dynamo_ftctl.lock.flock import flock_descriptor
from dynamo_ftctl.lock.owner import floor_path


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


def settles(path: Path, clock: FakeClock, **kwargs: float) -> list[float]:
    """The sleeps one acquisition (then release) makes on `clock`."""
    clock.sleeps.clear()
    lock = FlockLock(path, clock=clock, **{"watch_interval_s": 0.5, "term_grace_s": 5.0,
                                           **kwargs})
    lock.acquire(5)
    lock.release()
    return list(clock.sleeps)


def test_the_bound_is_interval_plus_grace_plus_margin() -> None:
    """0.5 s + 5 s + 0.5 s = 6 s with the defaults; no watch, no bound."""
    assert stop_bound_s(0.5, 5.0) == 6.0
    assert stop_bound_s(0.0, 5.0) == 0.0


def test_a_new_lock_file_is_settled_once(lock_path: Path) -> None:
    """A fresh deployment pays the bound once: the first acquisition sleeps 6 s, the next
    ones on the same file none."""
    clock = FakeClock()
    assert settles(lock_path, clock) == [6.0]
    assert settles(lock_path, clock) == []
    assert settles(lock_path, clock) == []


@pytest.mark.parametrize("attack", ["rm P", "rm P.floor", "rm both", "mv over P"])
def test_a_deleted_or_replaced_file_is_settled_again(lock_path: Path, attack: str) -> None:
    """After `rm P`, `rm P.floor`, both, or a `mv` over P while a holder keeps the old file
    open, the next acquisition holds the new file for the bound: the old holder may still
    run until then. (With nobody on the old file, its inode may come back for the new one:
    the floor knows it, and there is nobody to wait for.)"""
    clock = FakeClock()
    settles(lock_path, clock)
    old_holder = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)  # keeps the inode alive
    try:
        if attack in {"rm P", "rm both"}:
            lock_path.unlink()
        if attack in {"rm P.floor", "rm both"}:
            floor_path(lock_path).unlink()
        if attack == "mv over P":
            (lock_path.parent / "x").write_text("")
            (lock_path.parent / "x").rename(lock_path)
        assert settles(lock_path, clock) == [6.0]
        assert settles(lock_path, clock) == []
    finally:
        os.close(old_holder)


def test_no_watch_no_settle(lock_path: Path) -> None:
    """With the watch off (interval 0) there is no bound to wait for: flock(1) semantics."""
    assert settles(lock_path, FakeClock(), watch_interval_s=0) == []


def test_the_settle_follows_the_settings(lock_path: Path) -> None:
    """The bound comes from the interval and the grace the lock is given, or settle_s."""
    assert settles(lock_path, FakeClock(), watch_interval_s=0.1, term_grace_s=0.2) == [
        pytest.approx(0.8)]
    floor_path(lock_path).unlink()
    assert settles(lock_path, FakeClock(), settle_s=2.5) == [2.5]


class _Replacing(FakeClock):
    """A fake clock whose first sleep replaces the lock file (a `mv` during the settle)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if len(self.sleeps) == 1:
            (self.path.parent / "x").write_text("")
            (self.path.parent / "x").rename(self.path)


def test_a_file_replaced_during_the_settle_is_settled_anew(lock_path: Path) -> None:
    """The settled file is checked again afterwards: replaced meanwhile, the new file is
    locked and settled in its turn, and the lease is on the file at the path."""
    clock = _Replacing(lock_path)
    lock = FlockLock(lock_path, clock=clock, watch_interval_s=0.5, term_grace_s=5.0)
    lease = lock.acquire(5)
    assert clock.sleeps == [6.0, 6.0]
    assert lease.fd is not None
    assert os.fstat(lease.fd).st_ino == lock_path.stat().st_ino
    lock.release()


def test_the_fd_form_settles_a_new_file(lock_path: Path) -> None:
    """`--fd N` on a file the floor has not seen holds it for the bound before returning."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        clock = FakeClock()
        flock_descriptor(fd, clock=clock, settle_s=6.0)
        assert clock.sleeps == [6.0]
        clock.sleeps.clear()
        flock_descriptor(fd, clock=clock, settle_s=6.0)
        assert clock.sleeps == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_bad_term_grace_is_one_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """$FTCTL_LOCK_TERM_GRACE that is not seconds >= 0: InvalidInput naming the variable."""
    monkeypatch.setenv("FTCTL_LOCK_TERM_GRACE", raw)
    with pytest.raises(InvalidInput, match=r"\$FTCTL_LOCK_TERM_GRACE"):
        term_grace_from_env()
