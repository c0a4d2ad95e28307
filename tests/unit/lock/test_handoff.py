"""The fast handoff (issue 25): reserved tokens, the watcher started before the wait, the
`lock acquire` fast path; tokens stay unique, rising and durable."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_ftctl.cli.lock_fast import parse_acquire
from dynamo_ftctl.errors import LockTimeout
from dynamo_ftctl.lock import FlockLock
from dynamo_ftctl.lock.owner import floor_path, reserve_token, write_owner
from dynamo_ftctl.lock.protocol import Lease
from dynamo_ftctl.lock.watch import FileIdentity, prepare_watcher
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every descriptor fsynced while the test runs."""
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


def floor_doc(lock_path: Path) -> dict[str, int]:
    doc: dict[str, int] = json.loads(floor_path(lock_path).read_text())
    return doc


def issue(lock_path: Path, reserved: int | None) -> int:
    """Issue a token for `lock_path` as a holder does, with `reserved` from before its wait
    (the wall clock at the epoch: the tokens are the counter alone)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return write_owner(fd, floor_path(lock_path), str(lock_path),
                           locked=FileIdentity.of_fd(fd), engine_id=0, pid=os.getpid(),
                           acquired_at=0.0, reserved=reserved)
    finally:
        os.close(fd)


def reserve(lock_path: Path) -> int | None:
    """Reserve as a waiter does, the wall clock at the epoch."""
    return reserve_token(floor_path(lock_path), 0.0)


def test_reservation_is_durable_before_the_wait_and_the_grant_needs_no_fsync(
        lock_path: Path, fsyncs: list[int]) -> None:
    """A reservation raises the floor's high-water mark with an fsync; the grant then issues
    that token without one, and leaves the high-water mark's bytes as they were."""
    first = issue(lock_path, None)
    reserved = reserve(lock_path)
    assert reserved == first + 1
    assert floor_doc(lock_path)["token"] == reserved  # on disk before the wait
    before = floor_path(lock_path).read_bytes()
    fsyncs.clear()
    assert issue(lock_path, reserved) == reserved
    assert fsyncs == []
    after = floor_path(lock_path).read_bytes()
    assert len(after) == len(before)  # same size: no truncation a power loss could tear
    assert after.startswith(b'{"token":%d,' % reserved)
    assert floor_doc(lock_path)["issued"] == reserved


def test_overtaken_reservation_gets_a_fresh_higher_token_with_an_fsync(
        lock_path: Path, fsyncs: list[int]) -> None:
    """Two waiters reserve; the later one is granted first: the earlier one's reservation is
    stale, so it gets a token above the other's, fsynced before it is handed out."""
    issue(lock_path, None)
    early = reserve(lock_path)
    late = reserve(lock_path)
    assert early is not None
    assert late is not None
    assert issue(lock_path, late) == late
    fsyncs.clear()
    token = issue(lock_path, early)
    assert token > late
    assert fsyncs  # the stale reservation's replacement is durable before it is used
    assert floor_doc(lock_path)["token"] >= token


def test_no_reservation_without_a_floor(lock_path: Path) -> None:
    """Before the first token there is no floor, and the lock file's own claim may count:
    nothing is reserved (the grant issues with an fsync)."""
    assert reserve(lock_path) is None
    lock_path.write_text('{"token": 41}')
    assert issue(lock_path, None) == 42


def test_reservation_is_at_least_the_wall_clocks_token(lock_path: Path) -> None:
    """A reservation is above the floor and at least the wall clock's token (ms << 16)."""
    issue(lock_path, None)
    assert reserve_token(floor_path(lock_path), 1_700_000_000.0) == 1_700_000_000_000 << 16
    assert reserve_token(floor_path(lock_path), 0.0) == (1_700_000_000_000 << 16) + 1


def test_floor_of_an_older_ftctl_is_continued(lock_path: Path) -> None:
    """A floor without "issued" (written by an older ftctl) continues from its token."""
    lock_path.touch()
    st = lock_path.stat()
    floor_path(lock_path).write_text(json.dumps({"token": 7, "dev": st.st_dev,
                                                 "ino": st.st_ino}))
    assert issue(lock_path, reserve(lock_path)) == 8


def test_blocked_acquire_hands_over_the_reserved_token(lock_path: Path) -> None:
    """A waiter blocked in `acquire_here` gets the lock once the holder releases it, with the
    token it reserved, above the holder's."""
    holder = FlockLock(lock_path, watch_interval_s=0)
    held = holder.acquire()
    code = ("import sys\nfrom dynamo_ftctl.lock import FlockLock\n"
            "print(FlockLock(sys.argv[1], 1, watch_interval_s=0).acquire_here(30).token)")
    waiter = subprocess.Popen([sys.executable, "-c", code, str(lock_path)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline_reserved(lock_path, held.token + 1)
        reserved = floor_doc(lock_path)["token"]
        holder.release()
        out, _ = waiter.communicate(timeout=30)
    finally:
        waiter.kill()
        waiter.wait()
    assert int(out) == reserved > held.token
    assert floor_doc(lock_path)["issued"] == reserved


def deadline_reserved(lock_path: Path, high: int, timeout_s: float = 20.0) -> None:
    """Wait (bounded) until the floor's high-water mark reaches `high` (the waiter reserved)."""
    wait_until(lambda: floor_doc(lock_path)["token"], timeout_s,
               f"the waiter's reservation (floor token {high})", accept=lambda t: t >= high)


def test_acquire_here_times_out_and_the_next_token_is_higher(lock_path: Path) -> None:
    """A timed `acquire_here` in the main thread gives up with LockTimeout (SIGALRM); the
    next token is above the holder's and the timed-out waiter's reservation."""
    holder = FlockLock(lock_path, watch_interval_s=0)
    first = holder.acquire().token
    with pytest.raises(LockTimeout):
        FlockLock(lock_path, 1, watch_interval_s=0).acquire_here(0.05)
    reserved = floor_doc(lock_path)["token"]
    holder.release()
    assert FlockLock(lock_path, watch_interval_s=0).acquire_here(1).token > reserved > first


def test_cancelled_watcher_exits_and_is_reaped(tmp_path: Path) -> None:
    """A watcher started for a wait that ended without the lock exits at once, reaped."""
    watcher = prepare_watcher(tmp_path / "x.lock", interval_s=0.1, grace_s=1)
    watcher.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(watcher.pid, os.WNOHANG)


def test_lease_plain_text_matches_the_table_layout() -> None:
    """`acquire --fd` into a pipe prints key and value per line, keys aligned."""
    lease = Lease(lock="/l", backend="flock", engine_id=1, token=5, acquired_at=1.5,
                  waited_s=0.25, fd=9)
    assert lease.plain_text().splitlines() == [
        "lock         /l", "backend      flock", "engine_id    1", "token        5",
        "acquired_at  1.5", "waited_s     0.25", "fd           9"]


@pytest.mark.parametrize("args", [
    ["--path", "P", "--", "date"],
    ["-p", "P", "-t", "3", "--engine-id", "1", "--watch-interval", "0", "date", "-u"],
    ["--path=P", "--fd", "9", "--json"],
])
def test_fast_path_takes_the_plain_spellings(args: list[str]) -> None:
    """Plain `lock acquire` spellings run without the CLI framework."""
    assert parse_acquire(args) is not None


@pytest.mark.parametrize("args", [
    ["--help"], ["--backend", "etcd", "--", "date"], ["--path", "P", "--debug", "--", "x"],
    ["--path", "P"], ["--fd", "9", "--", "date"], ["--fd", "x"], ["--timeout", "nan", "x"],
    ["--fd", "9", "--watch-interval", "1"], ["--path"],
])
def test_fast_path_leaves_the_rest_to_the_full_cli(args: list[str]) -> None:
    """Help, other backends, unknown options, bad values and wrong combinations go to the
    full CLI, which says what is wrong."""
    assert parse_acquire(args) is None


def test_fast_path_needs_a_named_lock_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --path or $FAILOVER_LOCK_PATH the inventory names the file: the full CLI."""
    monkeypatch.delenv("FAILOVER_LOCK_PATH", raising=False)
    assert parse_acquire(["--", "date"]) is None
    monkeypatch.setenv("FAILOVER_LOCK_PATH", "/x.lock")
    assert parse_acquire(["--", "date"]) == {"command": ["date"]}


def test_fast_path_does_not_load_the_cli_framework(lock_path: Path) -> None:
    """`ftctl lock acquire --path P -- CMD` runs CMD without typer or click loaded (a lighter
    process execs faster)."""
    code = ("import sys, runpy\nsys.argv = ['ftctl', *sys.argv[1:]]\n"
            "import os\nos.execvpe = lambda *a: (print(sorted(m for m in sys.modules "
            "if m in ('typer', 'click', 'asyncio', 'rich'))), sys.exit(0))\n"
            "os.execve = lambda *a: (_ for _ in ()).throw(OSError(2, 'x'))\n"
            "runpy.run_module('dynamo_ftctl', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, "lock", "acquire", "--path",
                           str(lock_path), "--watch-interval", "0", "--", "true"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert proc.stdout.strip() == "[]", proc.stderr
