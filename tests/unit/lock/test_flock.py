"""FlockLock: acquire/release, contention, SIGKILLed holder, owner data, tokens, cancellation."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.errors import LockTimeout
from dynamo_ftctl.lock import FlockLock, read_owner
from tests.waiting import wait_until

HOLDER = """
import sys
from dynamo_ftctl.lock import FlockLock
lock = FlockLock(sys.argv[1], int(sys.argv[2]))
lease = lock.acquire(30)
print(lease.token, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


@pytest.fixture
def holder(lock_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A separate process holding the lock as engine 7 until its stdin closes or it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_path), "7"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip().isdigit()  # it holds the lock now
            yield proc
        finally:
            proc.kill()
            proc.wait(10)


def blocked_waiters(path: Path) -> int:
    """How many flock requests on `path`'s inode the kernel has queued (/proc/locks `->`)."""
    inode = path.stat().st_ino
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for line in lines if "->" in line and f":{inode} " in line)


def wait_for_waiters(path: Path, count: int) -> None:
    """Wait (at most 10 s) until `count` waiters are queued in the kernel on `path`."""
    wait_until(lambda: blocked_waiters(path), 10, f"{count} waiters blocked in flock",
               accept=lambda n: n >= count, interval=0.001)


def test_acquire_release_and_reacquire(lock_path: Path) -> None:
    """A free lock is acquired, released, and acquired again at once with a higher token."""
    lock = FlockLock(lock_path, engine_id=0)
    lease = lock.acquire(timeout=5)
    assert lock.is_held
    assert lease.engine_id == 0
    lock.release()
    assert not lock.is_held
    assert lock.acquire(timeout=1).token > lease.token
    lock.release()


def test_contention_times_out_with_lock_timeout(lock_path: Path) -> None:
    """While one object holds the lock another gets LockTimeout (exit 4), with and without waiting."""
    first = FlockLock(lock_path, engine_id=0)
    held = first.acquire()
    second = FlockLock(lock_path, engine_id=1)
    with pytest.raises(LockTimeout) as info:
        second.acquire(timeout=0)
    assert info.value.exit_code == 4
    assert "engine 0" in str(info.value)
    with pytest.raises(LockTimeout):
        second.acquire(timeout=0.05)
    first.release()
    assert second.acquire(timeout=1).token > held.token
    second.release()


def test_cross_process_holder_blocks_and_sigkill_hands_over(
    lock_path: Path, holder: subprocess.Popen[str],
) -> None:
    """A lock held by another process blocks us; SIGKILL of the holder hands it to the waiter."""
    waiter = FlockLock(lock_path, engine_id=1)
    with pytest.raises(LockTimeout):
        waiter.acquire(timeout=0.05)
    held = read_owner(lock_path)
    assert held is not None
    assert held.token is not None
    got: list[float] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10).token))
    thread.start()
    holder.send_signal(signal.SIGKILL)
    thread.join(15)
    assert len(got) == 1
    assert got[0] > held.token
    waiter.release()


def test_owner_reports_live_holder_then_stale_data(
    lock_path: Path, holder: subprocess.Popen[str],
) -> None:
    """owner() names the live holder; after its death the same data is reported as stale."""
    live = read_owner(lock_path)
    assert live is not None
    assert (live.live, live.engine_id, live.pid) == (True, 7, holder.pid)
    assert live.token is not None
    assert FlockLock(lock_path).status().held
    holder.kill()
    holder.wait(10)
    stale = read_owner(lock_path)
    assert stale is not None
    assert (stale.live, stale.engine_id, stale.pid, stale.token) == (False, 7, holder.pid,
                                                                     live.token)
    assert not FlockLock(lock_path).status().held


def test_owner_of_a_missing_or_empty_file_is_none(lock_path: Path) -> None:
    """No lock file, or one never written, means no owner at all."""
    assert read_owner(lock_path) is None
    lock_path.touch()
    assert read_owner(lock_path) is None


def test_owner_data_is_json_written_in_place(lock_path: Path) -> None:
    """The owner data is one JSON object in the locked inode itself (no rename)."""
    lock = FlockLock(lock_path, engine_id=3)
    lease = lock.acquire()
    inode = lock_path.stat().st_ino
    doc = json.loads(lock_path.read_text())
    assert doc["engine_id"] == 3
    assert doc["pid"] == os.getpid()
    assert doc["token"] == lease.token
    assert isinstance(doc["host"], str)
    assert doc["acquired_at"] > 0
    assert os.fstat(lease.fd or -1).st_ino == inode
    lock.release()


def test_fencing_token_rises_over_1000_handoffs(lock_path: Path) -> None:
    """1,000 handoffs between two engines issue 1,000 strictly rising tokens."""
    locks = [FlockLock(lock_path, engine_id=0), FlockLock(lock_path, engine_id=1)]
    tokens = []
    for i in range(1000):
        lock = locks[i % 2]
        tokens.append(lock.acquire(timeout=5).token)
        lock.release()
    assert all(later > earlier for earlier, later in itertools.pairwise(tokens))


def test_cancelled_sync_waiter_releases_the_lock_it_gets_later(lock_path: Path) -> None:
    """A waiter that timed out and is later granted the lock hands it on at once."""
    holder = FlockLock(lock_path, engine_id=0)
    holder.acquire()
    with pytest.raises(LockTimeout):
        FlockLock(lock_path, engine_id=1).acquire(timeout=0.05)
    assert blocked_waiters(lock_path) == 1  # the abandoned thread is still queued
    holder.release()
    third = FlockLock(lock_path, engine_id=2)
    assert third.acquire(timeout=10).token >= 2
    third.release()


def test_cancelled_async_waiter_never_keeps_the_lock(lock_path: Path) -> None:
    """Cancelling an aacquire task leaves the lock free for the next engine."""

    async def scenario() -> tuple[int, int]:
        holder = FlockLock(lock_path, engine_id=0)
        held = await holder.aacquire(5)
        task = asyncio.create_task(FlockLock(lock_path, engine_id=1).aacquire(None))
        await asyncio.to_thread(wait_for_waiters, lock_path, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        holder.release()
        third = FlockLock(lock_path, engine_id=2)
        lease = await third.aacquire(10)
        third.release()
        return held.token, lease.token

    first, last = asyncio.run(scenario())
    assert last > first


def test_async_waiter_is_woken_by_release(lock_path: Path) -> None:
    """aacquire blocks while the lock is held and returns once it is released."""

    async def scenario() -> tuple[int, int]:
        holder = FlockLock(lock_path, engine_id=0)
        held = holder.acquire()
        waiter = FlockLock(lock_path, engine_id=1)
        task = asyncio.create_task(waiter.aacquire(10))
        done, _ = await asyncio.wait({task}, timeout=0.05)
        assert not done
        holder.release()
        lease = await task
        waiter.release()
        return held.token, lease.token

    first, last = asyncio.run(scenario())
    assert last > first


def test_replaced_lock_file_is_locked_anew(lock_path: Path) -> None:
    """A waiter whose file was unlinked while it waited locks the new file, not the orphan,
    and its token continues from the floor (higher, not a restart)."""
    holder = FlockLock(lock_path, engine_id=0)
    held = holder.acquire()
    waiter = FlockLock(lock_path, engine_id=1)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10).token))
    thread.start()
    wait_for_waiters(lock_path, 1)  # it waits on the old inode
    lock_path.unlink()
    holder.release()
    thread.join(10)
    assert len(got) == 1
    assert got[0] > held.token  # a fresh file, yet the token goes on; on the linked inode
    lease = waiter.lease
    assert lease is not None
    assert lease.fd is not None
    assert os.fstat(lease.fd).st_ino == lock_path.stat().st_ino
    waiter.release()
