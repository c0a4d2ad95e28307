"""`flock(2)` failover lock for the engines of one node (a file on a shared emptyDir).

The kernel releases an flock with the holder's last descriptor, process death
included, so a waiter blocked in `flock(LOCK_EX)` runs the instant the holder
dies. Waiting is therefore a blocking `flock` in a helper thread, never a
`LOCK_NB` polling loop (which hands over 25 ms late on average, 50 ms at
worst). A waiter that gives up (timeout, cancelled task) leaves its thread in
the kernel queue; if that thread later gets the lock it releases it at once.

The lock file holds the owner data as JSON (engine id, pid, host, acquired-at
and the fencing token). The token is read, incremented and written back while
the lock is held, in place (a rename would create a new inode and with it a
second lock) and fsynced, so tokens grow by one on every acquisition.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import InvalidInput, LockTimeout
from dynamo_ftctl.lock.protocol import (
    Lease,
    LockStatus,
    OwnerInfo,
    record_acquired,
    record_released,
)

__all__ = ["FlockLock", "flock_descriptor", "read_owner", "unlock_descriptor"]

BACKEND = "flock"
# Owner data is ~150 bytes of JSON; anything past this is not ours.
_OWNER_MAX = 4096


class _Waiter:
    """A blocking `flock(fd, LOCK_EX)` in a daemon thread that can be abandoned.

    The waiter owns `fd`: if it is cancelled before the kernel grants the lock,
    the thread unlocks and closes the descriptor as soon as it is granted.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._state = threading.Lock()
        self._done = threading.Event()
        self._cancelled = False
        self._error: OSError | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="ftctl-flock-waiter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        error: OSError | None = None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError as exc:
            error = exc
        with self._state:
            if self._cancelled:
                # Nobody wants the lock any more: hand it on at once.
                with contextlib.suppress(OSError):
                    if error is None:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
                    os.close(self._fd)
                return
            self._error = error
            self._done.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the waiter thread) once the wait ends."""
        with self._state:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: float | None) -> bool:
        """True once the wait ended (lock granted or an error) within `timeout`."""
        return self._done.wait(timeout)

    def result(self) -> None:
        """Raise the error the wait ended with, if any."""
        if self._error is not None:
            raise self._error

    def cancel(self) -> bool:
        """Abandon the wait; True when the lock was granted first (the caller keeps it)."""
        with self._state:
            if self._done.is_set():
                return self._error is None
            self._cancelled = True
            return False


def _parse_owner(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (UnicodeDecodeError, ValueError, RecursionError):  # 4 KiB of "[" is too deep
        return {}
    return doc if isinstance(doc, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _owner_from(doc: dict[str, Any], *, lock: str, live: bool) -> OwnerInfo:
    acquired = doc.get("acquired_at")
    host = doc.get("host")
    return OwnerInfo(
        lock=lock, backend=BACKEND, live=live,
        engine_id=_int_or_none(doc.get("engine_id")), pid=_int_or_none(doc.get("pid")),
        host=host if isinstance(host, str) else None,
        acquired_at=float(acquired) if isinstance(acquired, int | float) else None,
        token=_int_or_none(doc.get("token")),
    )


def _write_owner(fd: int, *, engine_id: int, pid: int, acquired_at: float) -> int:
    """Read the last token, write owner data with token + 1 in place; return the token.

    Must be called while holding the lock: the read-modify-write is what makes
    tokens unique. A single pwrite cannot be torn by the death of this process.
    """
    previous = _int_or_none(_parse_owner(os.pread(fd, _OWNER_MAX, 0)).get("token")) or 0
    token = previous + 1
    payload = json.dumps({
        "engine_id": engine_id, "pid": pid, "host": socket.gethostname(),
        "acquired_at": acquired_at, "token": token,
    }, separators=(",", ":")).encode() + b"\n"
    os.pwrite(fd, payload, 0)
    os.ftruncate(fd, len(payload))
    os.fsync(fd)
    return token


def read_owner(path: Path) -> OwnerInfo | None:
    """Owner data of the lock file at `path`, probing whether its holder is alive.

    The probe opens a second open file description and asks for a shared lock
    without blocking: granted means nobody holds the lock (the data is stale),
    refused means a live holder. Reading under that shared lock also means no
    holder can be rewriting the data while it is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot open lock file: {exc.strerror}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live = True
        else:
            live = False
        data = os.pread(fd, _OWNER_MAX, 0)
        if not live:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    doc = _parse_owner(data)
    if not doc and not live:
        return None
    return _owner_from(doc, lock=str(path), live=live)


class FlockLock:
    """The flock backend of `FailoverLock` (engines on one node).

    One object holds the lock at most once at a time; `lease.fd` is the locked
    descriptor (close-on-exec unless made inheritable for `exec`).
    """

    def __init__(
        self, path: Path | str, engine_id: int = 0, *, clock: Clock = SYSTEM_CLOCK,
        metrics: bool = False,
    ) -> None:
        self._path = Path(path)
        self._engine_id = engine_id
        self._clock = clock
        self._metrics = metrics
        self._lease: Lease | None = None

    @property
    def name(self) -> str:
        return str(self._path)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def is_held(self) -> bool:
        return self._lease is not None

    @property
    def lease(self) -> Lease | None:
        """The current lease, None when not held."""
        return self._lease

    def _open(self) -> int:
        try:
            return os.open(self._path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise InvalidInput(f"{self._path}: cannot open lock file: {exc.strerror}") from exc

    def _still_linked(self, fd: int) -> bool:
        """False when the file was unlinked or replaced while we waited (a different lock)."""
        try:
            st = self._path.stat()
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _take(self, fd: int, started: float) -> Lease:
        acquired_at = self._clock.wall()
        try:
            token = _write_owner(fd, engine_id=self._engine_id, pid=os.getpid(),
                                 acquired_at=acquired_at)
        except OSError as exc:  # disk full, read-only volume: do not keep a lock without a token
            os.close(fd)
            msg = f"{self.name}: cannot write owner data: {exc.strerror}"
            raise InvalidInput(msg) from exc
        lease = Lease(
            lock=self.name, backend=BACKEND, engine_id=self._engine_id, token=token,
            acquired_at=acquired_at, waited_s=max(0.0, self._clock.now() - started), fd=fd,
        )
        self._lease = lease
        if self._metrics:
            record_acquired(lease)
        return lease

    def _check_free(self) -> None:
        if self._lease is not None:
            msg = f"{self.name}: this FlockLock already holds the lock"
            raise InvalidInput(msg)

    @staticmethod
    def _try_now(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _timeout_error(self, timeout: float | None) -> LockTimeout:
        holder = read_owner(self._path)
        who = f" (held by engine {holder.engine_id}, pid {holder.pid})" if holder else ""
        return LockTimeout(f"{self.name}: lock not acquired within {timeout:g} s{who}")

    def acquire(self, timeout: float | None = None) -> Lease:
        """Block (at most `timeout` s, None = forever) until held; `LockTimeout` otherwise."""
        self._check_free()
        started = self._clock.now()
        while True:
            fd = self._open()
            if not self._try_now(fd):
                if timeout is not None and timeout <= 0:
                    os.close(fd)
                    raise self._timeout_error(timeout)
                waiter = _Waiter(fd)
                waiter.start()
                remaining = None if timeout is None else timeout - (self._clock.now() - started)
                ended = waiter.wait(None if remaining is None else max(0.0, remaining))
                if not ended and not waiter.cancel():
                    raise self._timeout_error(timeout)
                try:
                    waiter.result()
                except OSError as exc:
                    os.close(fd)
                    raise InvalidInput(f"{self.name}: flock failed: {exc.strerror}") from exc
            if self._still_linked(fd):
                return self._take(fd, started)
            os.close(fd)  # the file was replaced under us: lock the new one

    async def aacquire(self, timeout: float | None = None) -> Lease:
        """`acquire` for asyncio; a cancelled task never keeps the lock."""
        self._check_free()
        started = self._clock.now()
        loop = asyncio.get_running_loop()
        while True:
            fd = self._open()
            if not self._try_now(fd):
                if timeout is not None and timeout <= 0:
                    os.close(fd)
                    raise self._timeout_error(timeout)
                waiter = _Waiter(fd)
                granted: asyncio.Future[None] = loop.create_future()

                def settle(future: asyncio.Future[None] = granted) -> None:
                    if not future.done():
                        future.set_result(None)

                def wake() -> None:
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        loop.call_soon_threadsafe(settle)

                waiter.add_done_callback(wake)
                waiter.start()
                remaining = None if timeout is None else timeout - (self._clock.now() - started)
                try:
                    await asyncio.wait_for(asyncio.shield(granted),
                                           None if remaining is None else max(0.0, remaining))
                except TimeoutError:
                    if not waiter.cancel():
                        raise self._timeout_error(timeout) from None
                except asyncio.CancelledError:
                    if waiter.cancel():  # granted just as we were cancelled: give it back
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        os.close(fd)
                    raise
                try:
                    waiter.result()
                except OSError as exc:
                    os.close(fd)
                    raise InvalidInput(f"{self.name}: flock failed: {exc.strerror}") from exc
            if self._still_linked(fd):
                return self._take(fd, started)
            os.close(fd)

    def release(self) -> None:
        """Unlock and close the descriptor; the owner data (and its token) stay."""
        lease, self._lease = self._lease, None
        if lease is None or lease.fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(lease.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(lease.fd)
        if self._metrics:
            record_released(self.name, self._engine_id)

    def detach(self) -> Lease:
        """Forget the lease without unlocking: its descriptor now belongs to the caller."""
        lease, self._lease = self._lease, None
        if lease is None:
            msg = f"{self.name}: not held"
            raise InvalidInput(msg)
        return lease

    def owner(self) -> OwnerInfo | None:
        return read_owner(self._path)

    def status(self) -> LockStatus:
        """Held or free, with the owner data."""
        owner = self.owner()
        return LockStatus(lock=self.name, backend=BACKEND,
                          held=owner is not None and owner.live, owner=owner)


class _AlarmExpired(Exception):
    pass


@contextlib.contextmanager
def _alarm(timeout: float | None) -> Iterator[None]:
    """Interrupt a blocking syscall in the main thread after `timeout` s (like flock(1) -w)."""
    if timeout is None:
        yield
        return

    def expire(_signum: int, _frame: FrameType | None) -> None:
        raise _AlarmExpired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(timeout, 1e-6))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def flock_descriptor(
    fd: int, engine_id: int = 0, *, timeout: float | None = None, holder_pid: int | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> Lease:
    """Lock an already open descriptor (`exec 9<>P; ftctl lock acquire --fd 9`).

    The descriptor's open file description is shared with the calling shell,
    so the lock outlives this process. The wait runs in the main thread and a
    timeout interrupts it with SIGALRM: an interrupted flock is never granted,
    whereas a helper thread granted the lock just before this process exits
    would leave the shell holding a lock it was told it did not get.
    """
    started = clock.now()
    try:
        os.fstat(fd)
    except OSError as exc:
        raise InvalidInput(f"--fd {fd}: not an open descriptor ({exc.strerror})") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if timeout is not None and timeout <= 0:
                raise _AlarmExpired from None
            with _alarm(timeout):
                fcntl.flock(fd, fcntl.LOCK_EX)
    except _AlarmExpired:
        raise LockTimeout(f"--fd {fd}: lock not acquired within {timeout:g} s") from None
    except OSError as exc:
        raise InvalidInput(f"--fd {fd}: flock failed: {exc.strerror}") from exc
    proc_fd = Path(f"/proc/self/fd/{fd}")
    name = str(proc_fd.readlink()) if proc_fd.exists() else f"fd:{fd}"
    # `exec 9>P` opens write-only: read and write the owner data through a
    # second description of the same file (the lock stays on the shell's).
    readable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY
    data_fd = fd if readable else os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        acquired_at = clock.wall()
        token = _write_owner(data_fd, engine_id=engine_id,
                             pid=os.getppid() if holder_pid is None else holder_pid,
                             acquired_at=acquired_at)
    finally:
        if data_fd != fd:
            os.close(data_fd)
    return Lease(lock=name, backend=BACKEND, engine_id=engine_id, token=token,
                 acquired_at=acquired_at, waited_s=max(0.0, clock.now() - started), fd=fd)


def unlock_descriptor(fd: int) -> None:
    """Release the lock held through `fd` (`ftctl lock release --fd 9`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise InvalidInput(f"--fd {fd}: not an open descriptor") from exc
        raise InvalidInput(f"--fd {fd}: unlock failed: {exc.strerror}") from exc
