"""`flock(2)` failover lock for the engines of one node (a file on a shared emptyDir).

The kernel releases an flock with the holder's last descriptor, process death
included, so a waiter blocked in `flock(LOCK_EX)` runs the instant the holder dies.
Waiting is therefore a blocking `flock` in a helper thread, never a `LOCK_NB`
polling loop (which hands over half its interval late on average, a whole interval
at worst; docs/benchmarks.md, "lock.py"). A waiter that gives up (timeout, cancelled
task) leaves its thread in the kernel queue; if that thread later gets the lock it
releases it at once.

The lock file holds the owner data as JSON (engine id, pid, host, acquired-at
and the fencing token), written in place while the lock is held (a rename would
create a new inode and with it a second lock); `owner.py` reads and writes it
and issues the tokens.

Tokens come from the token floor `P.floor` beside the lock file `P`: the last
token issued and the device and inode of the lock file it was issued for. An
issuer flocks the floor for the few microseconds of its read-modify-write (so
issuers on two different inodes, when `P` was replaced, still take turns),
issues one above the floor, and one above the lock file's own claim only when
the floor last saw that very inode (in-place writes, which older ftctl versions
make, continue the sequence). A lock file deleted, truncated or replaced by
another file (a `mv` of a copy claiming token 1001) therefore neither lowers nor
raises the sequence: its claim is ignored, with a warning when it was higher.
Only when the floor is missing too (first use, or both files deleted) does the
lock file's claim (0 for a new file) start it. Trust: whoever may write the
directory may rewrite both files; the floor guards against accidents (a cleanup
`rm`, a tool that writes by rename, `exec 9>P` truncating), not a forger.

Durability: no token is handed out before a floor value at least as high is
on disk (fsynced; its directory too, once, when the floor is created), so
after a power loss and reboot the next token is still higher than any handed
out before. A waiter that must block reserves its token first: it raises the
floor's high-water mark by one and fsyncs it while the holder still runs, so
the handoff itself writes the floor without an fsync (a reservation that
another waiter overtook is dropped, and the grant fsyncs a fresh token). An
acquisition that does not wait fsyncs at the grant. The owner data is not
fsynced (only `owner`/`status` read it, and the floor does not depend on it).

A held lock is watched (`watch.py`): every `watch_interval_s` the path is
compared with the locked inode; when it was deleted or replaced the lock is
lost: `is_held` turns False, `ensure_held` raises `LeaseLost` and the
`on_lost` callback is told. The other side of that watch: a lock file the floor
has not seen (new, or replacing the one the last token was issued for) is held
for `settle_s` (the stop bound, `bound.py`) before its token is issued, so the
holder of a deleted or replaced file has stopped before the new holder runs.

Files: the lock file and the floor are opened only as regular files of one name
(`safefiles.open_regular`: no symbolic link followed, no FIFO, device, socket or
hard-linked file; exit 2), and after the flock the path must still name the
inode locked (`lstat`), else the new file is locked instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import InvalidInput, LeaseLost, LockTimeout, OutputRefused
from dynamo_ftctl.lock.bound import stop_bound_s, term_grace_from_env, watch_interval_from_env
from dynamo_ftctl.lock.owner import (
    BACKEND,
    FLOOR_SUFFIX,
    floor_knows,
    floor_path,
    read_owner,
    reserve_token,
    write_owner,
)
from dynamo_ftctl.lock.protocol import (
    Lease,
    LockStatus,
    OwnerInfo,
    record_acquired,
    record_released,
)
from dynamo_ftctl.lock.watch import FILE_WATCH, FileIdentity, lock_file_gone
from dynamo_ftctl.safefiles import open_regular, reopen_rw

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "FLOOR_SUFFIX", "FlockLock", "flock_descriptor", "floor_path", "read_owner",
    "unlock_descriptor",
]

_log = logging.getLogger("ftctl.lock")


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


class FlockLock:
    """The flock backend of `FailoverLock` (engines on one node).

    One object holds the lock at most once at a time; `lease.fd` is the locked
    descriptor (close-on-exec unless made inheritable for `exec`). While held,
    the lock file is checked every `watch_interval_s` (0: never); when it was
    deleted or replaced, `on_lost` is called (from a helper thread) with a
    `LeaseLost`, and the holder must stop serving within `term_grace_s`.

    `watch_interval_s` and `term_grace_s` default to `$FTCTL_LOCK_WATCH_INTERVAL`
    (0.5 s) and `$FTCTL_LOCK_TERM_GRACE` (5 s): every holder of one lock must use the
    same. `settle_s` (default: their stop bound, `bound.stop_bound_s`; 0 with the
    watch off) is how long an acquisition holds a lock file the floor has not seen
    before it issues the token and returns.
    """

    def __init__(
        self, path: Path | str, engine_id: int = 0, *, clock: Clock = SYSTEM_CLOCK,
        metrics: bool = False, watch_interval_s: float | None = None,
        term_grace_s: float | None = None, settle_s: float | None = None,
        on_lost: Callable[[LeaseLost], None] | None = None,
    ) -> None:
        self._path = Path(path)
        self._floor = floor_path(self._path)
        self._engine_id = engine_id
        self._clock = clock
        self._metrics = metrics
        self._watch_interval_s = (watch_interval_from_env() if watch_interval_s is None
                                  else watch_interval_s)
        self.term_grace_s = term_grace_from_env() if term_grace_s is None else term_grace_s
        self.settle_s = (stop_bound_s(self._watch_interval_s, self.term_grace_s)
                         if settle_s is None else settle_s)
        self._on_lost = on_lost
        self._guard = threading.Lock()
        self._lease: Lease | None = None
        self._lost: LeaseLost | None = None
        self._watch: object | None = None

    @property
    def name(self) -> str:
        return str(self._path)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def is_held(self) -> bool:
        """True while held and the lock file is still the locked one (as last checked)."""
        with self._guard:
            return self._lease is not None and self._lost is None

    @property
    def lease(self) -> Lease | None:
        """The current lease, None when not held."""
        return self._lease

    @property
    def lost(self) -> LeaseLost | None:
        """The loss, once the lock file was found deleted or replaced while held."""
        with self._guard:
            return self._lost

    def set_on_lost(self, callback: Callable[[LeaseLost], None] | None) -> None:
        """Replace the callback told (from a helper thread) that the lock was lost."""
        self._on_lost = callback

    def ensure_held(self) -> Lease:
        """The lease, or `LeaseLost` (checks the file now: call before every fenced write)."""
        with self._guard:
            lease, lost = self._lease, self._lost
        if lost is not None:
            raise lost
        if lease is None or lease.fd is None:
            msg = f"{self.name}: not held"
            raise LeaseLost(msg)
        reason = lock_file_gone(self._path, FileIdentity.of_fd(lease.fd))
        if reason is not None:
            self._lose(lease, reason)
            raise self._lost or LeaseLost(f"{self.name}: not held")
        return lease

    def _lose(self, lease: Lease, reason: str) -> None:
        """The lock file is gone: record the loss once and tell the holder."""
        with self._guard:
            if self._lease is not lease or self._lost is not None:
                return
            self._lost = LeaseLost(
                f"{self.name}: lock lost (token {lease.token}): the lock file was {reason}; "
                "another engine may hold the lock now")
            lost, watch, self._watch = self._lost, self._watch, None
        if watch is not None:
            FILE_WATCH.unwatch(watch)
        if self._metrics:
            record_released(self.name, self._engine_id)
        callback = self._on_lost
        if callback is not None:
            callback(lost)

    def _open(self) -> int:
        """The lock file, made if missing; never through a link, and only a regular file
        with one name (a planted link, FIFO or device is `OutputRefused`, exit 2)."""
        try:
            return open_regular(self._path, os.O_CREAT | os.O_RDWR)
        except OSError as exc:
            raise InvalidInput(f"{self._path}: cannot open lock file: {exc.strerror}") from exc

    def _still_linked(self, fd: int) -> bool:
        """False when the file was unlinked or replaced while we waited (a different lock)."""
        return lock_file_gone(self._path, FileIdentity.of_fd(fd)) is None

    def _ready(self, fd: int) -> bool:
        """After the flock: True once `fd` is the file at the path and settled (see
        `_settle`); False when the path names another file now (lock that one). Closes
        `fd` on an error."""
        try:
            return self._still_linked(fd) and _settle(self._path, self._floor, fd,
                                                      self.settle_s, self._clock)
        except BaseException:
            os.close(fd)
            raise

    def _take(self, fd: int, started: float, reserved: int | None) -> Lease:
        acquired_at = self._clock.wall()
        locked = FileIdentity.of_fd(fd)
        try:
            token = write_owner(fd, self._floor, self.name, locked=locked,
                                 engine_id=self._engine_id, pid=os.getpid(),
                                 acquired_at=acquired_at, reserved=reserved)
        except OSError as exc:  # disk full, read-only volume: do not keep a lock without a token
            os.close(fd)
            msg = f"{self.name}: cannot write owner data: {exc.strerror}"
            raise InvalidInput(msg) from exc
        except BaseException:
            os.close(fd)
            raise
        lease = Lease(
            lock=self.name, backend=BACKEND, engine_id=self._engine_id, token=token,
            acquired_at=acquired_at, waited_s=max(0.0, self._clock.now() - started), fd=fd,
        )
        with self._guard:
            self._lease, self._lost = lease, None
        if self._watch_interval_s > 0:
            handle = FILE_WATCH.watch(self._path, locked, self._watch_interval_s,
                                      lambda reason: self._lose(lease, reason))
            with self._guard:
                self._watch = handle
        if self._metrics:
            record_acquired(lease)
        return lease

    def _check_free(self) -> None:
        if self._lease is not None:
            msg = f"{self.name}: this FlockLock already holds the lock"
            raise InvalidInput(msg)
        if self._watch_interval_s > 0:
            FILE_WATCH.start()  # before the wait, not in the handoff

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

    def _open_and_try(self, timeout: float | None) -> tuple[int, bool]:
        """The lock file's descriptor and whether it is locked at once; `LockTimeout` when
        it is not and there is no time to wait."""
        fd = self._open()
        if self._try_now(fd):
            return fd, True
        if timeout is not None and timeout <= 0:
            os.close(fd)
            raise self._timeout_error(timeout)
        return fd, False

    def acquire(self, timeout: float | None = None) -> Lease:
        """Block (at most `timeout` s, None = forever) until held; `LockTimeout` otherwise."""
        return self._acquire_by(timeout, self._wait_in_thread)

    def acquire_here(self, timeout: float | None = None) -> Lease:
        """`acquire`, waiting in `flock(2)` in this thread: the granted lock runs on with
        no thread to wake (what `ftctl lock acquire -- CMD` needs to exec as fast as
        flock(1)). A timeout interrupts the wait with SIGALRM, so it needs the main thread;
        elsewhere a timed wait goes to `acquire`."""
        if timeout is not None and threading.current_thread() is not threading.main_thread():
            return self.acquire(timeout)
        return self._acquire_by(timeout, self._wait_here)

    def _acquire_by(self, timeout: float | None,
                    wait: Callable[[int, float | None, float | None], None]) -> Lease:
        """Lock the file at the path, blocking in `wait(fd, seconds left, timeout)` when it
        is held; the token is reserved before the first wait (fsynced while the holder
        runs). `timeout` bounds the wait for the lock, not the settle wait after it."""
        self._check_free()
        started = self._clock.now()
        reserved: int | None = None
        while True:
            fd, held = self._open_and_try(timeout)
            if not held:
                if reserved is None:
                    reserved = reserve_token(self._floor, self._clock.wall())
                left = None if timeout is None else timeout - (self._clock.now() - started)
                wait(fd, None if left is None else max(0.0, left), timeout)
            if self._ready(fd):
                return self._take(fd, started, reserved)
            os.close(fd)  # the file was replaced under us: lock the new one

    def _wait_in_thread(self, fd: int, left: float | None, timeout: float | None) -> None:
        """Wait in a `_Waiter` thread (any thread may call `acquire` with a timeout)."""
        waiter = _Waiter(fd)
        waiter.start()
        if not waiter.wait(left) and not waiter.cancel():
            raise self._timeout_error(timeout)  # the waiter closes `fd` once granted
        try:
            waiter.result()
        except OSError as exc:
            os.close(fd)
            raise InvalidInput(f"{self.name}: flock failed: {exc.strerror}") from exc

    def _wait_here(self, fd: int, left: float | None, timeout: float | None) -> None:
        """Wait in this thread, SIGALRM ending it after `left` s (main thread only)."""
        try:
            with _alarm(left):
                fcntl.flock(fd, fcntl.LOCK_EX)
        except _AlarmExpired:
            os.close(fd)  # granted just as the alarm fired: closing hands it on
            raise self._timeout_error(timeout) from None
        except OSError as exc:
            os.close(fd)
            raise InvalidInput(f"{self.name}: flock failed: {exc.strerror}") from exc

    async def aacquire(self, timeout: float | None = None) -> Lease:
        """`acquire` for asyncio; a cancelled task never keeps the lock."""
        import asyncio  # only here: `ftctl lock acquire` must not load it

        self._check_free()
        started = self._clock.now()
        loop = asyncio.get_running_loop()
        reserved: int | None = None
        while True:
            fd, held = self._open_and_try(timeout)
            if not held:
                if reserved is None:
                    reserved = reserve_token(self._floor, self._clock.wall())
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
            try:
                ready = self._still_linked(fd)
                if ready and _must_settle(self._floor, fd, self.settle_s):
                    _log.info(_SETTLING, self._path, self.settle_s)
                    await self._clock.asleep(self.settle_s)
                    ready = self._still_linked(fd)
            except BaseException:  # cancelled while settling: the lock goes with `fd`
                os.close(fd)
                raise
            if ready:
                return self._take(fd, started, reserved)
            os.close(fd)

    def release(self) -> None:
        """Unlock and close the descriptor; the owner data (and its token) stay."""
        with self._guard:
            lease, self._lease = self._lease, None
            lost, self._lost = self._lost, None
            watch, self._watch = self._watch, None
        if watch is not None:
            FILE_WATCH.unwatch(watch)
        if lease is None or lease.fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(lease.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(lease.fd)
        if self._metrics and lost is None:  # a loss already exported the release
            record_released(self.name, self._engine_id)

    def detach(self) -> Lease:
        """Forget the lease without unlocking (and stop watching): its descriptor now
        belongs to the caller."""
        with self._guard:
            lease, self._lease = self._lease, None
            self._lost = None
            watch, self._watch = self._watch, None
        if watch is not None:
            FILE_WATCH.unwatch(watch)
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


_SETTLING = ("%s: a lock file the token floor has not seen: waiting %.1f s, the bound "
             "within which a holder of a deleted or replaced lock file stops")


def _must_settle(floor: Path, fd: int, settle_s: float) -> bool:
    """True when the lock on `fd` must be held `settle_s` before use: the floor has not
    seen its inode (a new lock file, or one replacing the file of the last token)."""
    return settle_s > 0 and not floor_knows(floor, FileIdentity.of_fd(fd))


def _settle(path: Path, floor: Path, fd: int, settle_s: float, clock: Clock) -> bool:
    """Hold the lock on `fd` for `settle_s` when `_must_settle`: a holder of a deleted or
    replaced file stops within that bound (`bound.py`), so it has stopped when this
    returns. True when `fd` is still the file at `path` afterwards."""
    if not _must_settle(floor, fd, settle_s):
        return True
    _log.info(_SETTLING, path, settle_s)
    clock.sleep(settle_s)
    return lock_file_gone(path, FileIdentity.of_fd(fd)) is None


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
    clock: Clock = SYSTEM_CLOCK, settle_s: float | None = None,
) -> Lease:
    """Lock an already open descriptor (`exec 9<>P; ftctl lock acquire --fd 9`).

    The descriptor's open file description is shared with the calling shell,
    so the lock outlives this process. The wait runs in the main thread and a
    timeout interrupts it with SIGALRM: an interrupted flock is never granted,
    whereas a helper thread granted the lock just before this process exits
    would leave the shell holding a lock it was told it did not get. A file the
    floor has not seen is held `settle_s` first (default: the stop bound of the
    pod-wide settings, `bound.py`).
    """
    started = clock.now()
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise InvalidInput(f"--fd {fd}: not an open descriptor ({exc.strerror})") from exc
    if not stat.S_ISREG(st.st_mode):
        msg = f"--fd {fd}: not a regular file (open the lock file: exec {fd}<>PATH)"
        raise InvalidInput(msg)
    if st.st_nlink > 1:  # as `safefiles.open_regular` refuses it: the data would go there too
        raise OutputRefused(f"--fd {fd}", f"refusing the lock file: it has {st.st_nlink} "
                                          "hard links (a lock file must have one name)")
    path = _descriptor_path(fd)
    floor = None if path is None else floor_path(path)
    reserved: int | None = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if timeout is not None and timeout <= 0:
                raise _AlarmExpired from None
            if floor is not None:  # fsynced now, while the holder runs
                reserved = reserve_token(floor, clock.wall())
            with _alarm(None if timeout is None else timeout - (clock.now() - started)):
                fcntl.flock(fd, fcntl.LOCK_EX)
    except _AlarmExpired:
        raise LockTimeout(f"--fd {fd}: lock not acquired within {timeout:g} s") from None
    except OSError as exc:
        raise InvalidInput(f"--fd {fd}: flock failed: {exc.strerror}") from exc
    locked = FileIdentity(st.st_dev, st.st_ino)
    if path is not None:
        if settle_s is None:
            settle_s = stop_bound_s(watch_interval_from_env(), term_grace_from_env())
        try:
            reason = lock_file_gone(path, locked)
            if reason is None and floor is not None and not _settle(path, floor, fd,
                                                                    settle_s, clock):
                reason = lock_file_gone(path, locked) or "replaced by another file"
        except BaseException:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            raise
        if reason is not None:  # the shell opened a file no other engine will lock
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            msg = (f"--fd {fd}: {path} was {reason} since the shell opened it: locking "
                   f"this descriptor excludes nobody; reopen it (exec {fd}<>{path}) and retry")
            raise LeaseLost(msg)
    # `exec 9>P` opens write-only: read and write the owner data through a
    # second description of the same file (the lock stays on the shell's).
    readable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY
    data_fd = fd if readable else reopen_rw(fd)
    try:
        acquired_at = clock.wall()
        token = write_owner(data_fd, floor, str(path or f"fd:{fd}"), locked=locked,
                             engine_id=engine_id,
                             pid=os.getppid() if holder_pid is None else holder_pid,
                             acquired_at=acquired_at, reserved=reserved)
    except BaseException:
        with contextlib.suppress(OSError):  # no token, no lock
            fcntl.flock(fd, fcntl.LOCK_UN)
        raise
    finally:
        if data_fd != fd:
            os.close(data_fd)
    return Lease(lock=str(path) if path else f"fd:{fd}", backend=BACKEND, engine_id=engine_id,
                 token=token, acquired_at=acquired_at,
                 waited_s=max(0.0, clock.now() - started), fd=fd)


def _descriptor_path(fd: int) -> Path | None:
    """The path `fd` was opened with (from /proc; " (deleted)" stripped), None without /proc."""
    try:
        target = str(Path(f"/proc/self/fd/{fd}").readlink())
    except OSError:
        return None
    deleted = " (deleted)"
    return Path(target.removesuffix(deleted) if target.endswith(deleted) else target)


def unlock_descriptor(fd: int) -> None:
    """Release the lock held through `fd` (`ftctl lock release --fd 9`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise InvalidInput(f"--fd {fd}: not an open descriptor") from exc
        raise InvalidInput(f"--fd {fd}: unlock failed: {exc.strerror}") from exc
