"""Noticing that a held flock lock file was deleted or replaced, and telling the holder.

An flock lives on an inode, not on a name: once the file at the lock path is
unlinked or renamed over, the next engine creates or opens a new inode and locks
it. The kernel tells nobody, so the holder checks: it compares the path's device
and inode (`lstat`: a symbolic link put there is a replacement too) with its
locked descriptor's (`lock_file_gone`, the one verdict). The next engine, for its
part, holds a lock file the floor has not seen for the stop bound before it runs
(`bound.py`, `flock.py`), so the old holder has stopped first.

Two forms, for the two ways a lock is held:

- `FileWatch`: one daemon thread per process checks every watched `FlockLock`
  held in it every `interval` seconds (a thread per acquisition would cost
  ~0.2 ms on the hot path);
- `prepare_watcher`: for `ftctl lock acquire -- CMD`, which execs CMD, a
  watcher process started before the wait (off the handoff) and armed with the
  locked inode and token after the grant outlives the exec, signals CMD
  (SIGTERM, then SIGKILL after a grace period) when the file is gone, and exits
  with CMD. It is woken by inotify (`inotify.py`: the inode unlinked or renamed,
  a name created or moved in its directory), so it tells CMD within milliseconds,
  and checks every `interval` seconds as well, where inotify is missing or blind
  (network file systems).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.lock.bound import WATCH_INTERVAL_S

if TYPE_CHECKING:
    from dynamo_ftctl.lock.inotify import InodeEvents

__all__ = [
    "WATCH_INTERVAL_S", "FileIdentity", "FileWatch", "PendingWatcher", "lock_file_gone",
    "prepare_watcher", "spawn_watcher", "watcher_main",
]

_log = logging.getLogger("ftctl.lock")


@dataclass(frozen=True)
class FileIdentity:
    """Which inode a descriptor locks: device and inode number."""

    dev: int
    ino: int

    @classmethod
    def of_fd(cls, fd: int) -> FileIdentity:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino)


def lock_file_gone(path: Path, locked: FileIdentity) -> str | None:
    """Why the file at `path` is no longer the `locked` inode ("deleted", "replaced by
    another file", a symbolic link included), or None while it still is (or when it
    cannot be told: no permission)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "deleted"
    except OSError:
        return None  # cannot tell; the next check may
    if (st.st_dev, st.st_ino) != (locked.dev, locked.ino):
        return "replaced by another file"
    return None


class _Watched:
    """One watched lock: where, which inode, how often, whom to tell."""

    def __init__(self, path: Path, locked: FileIdentity, interval_s: float,
                 tell: Callable[[str], None]) -> None:
        self.path = path
        self.locked = locked
        self.interval_s = interval_s
        self.tell = tell
        self.due = time.monotonic() + interval_s


class FileWatch:
    """A daemon thread that checks every registered lock file at its interval.

    `watch` returns a handle for `unwatch`; `tell(reason)` is called once, from
    the thread, when the file is gone, and the lock is then no longer watched.
    The thread starts on first use (again in a forked child) and sleeps while
    nothing is watched.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: set[_Watched] = set()
        self._thread: threading.Thread | None = None
        # When the thread wakes next on its own (inf: only when notified).
        self._wakes_at = math.inf

    def start(self) -> None:
        """Start the thread now if it is not running (acquirers call this before they wait:
        starting a thread costs ~0.2 ms, which must not delay a handoff)."""
        with self._cond:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():  # (not alive: after a fork)
            self._thread = threading.Thread(target=self._run, name="ftctl-lock-watch",
                                            daemon=True)
            self._thread.start()

    def watch(self, path: Path, locked: FileIdentity, interval_s: float,
              tell: Callable[[str], None]) -> object:
        handle = _Watched(path, locked, interval_s, tell)
        with self._cond:
            self._watched.add(handle)
            self._start_locked()
            if handle.due < self._wakes_at:
                # Only then: a thread woken on every acquisition would take the GIL from
                # the acquirer, on the handoff's path.
                self._cond.notify()
        return handle

    def unwatch(self, handle: object) -> None:
        if isinstance(handle, _Watched):
            with self._cond:
                self._watched.discard(handle)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watched:
                    self._wakes_at = math.inf
                    self._cond.wait()
                now = time.monotonic()
                due = [w for w in self._watched if w.due <= now]
                if not due:
                    self._wakes_at = min(w.due for w in self._watched)
                    self._cond.wait(self._wakes_at - now)
                    continue
                for w in due:
                    w.due = now + w.interval_s
            for w in due:
                reason = lock_file_gone(w.path, w.locked)
                if reason is None:
                    continue
                with self._cond:
                    if w not in self._watched:
                        continue  # released meanwhile: nobody to tell
                    self._watched.discard(w)
                try:
                    w.tell(reason)
                except Exception:  # a holder's callback must not end the watch of the others
                    _log.exception("%s: telling the holder its lock was lost failed", w.path)


FILE_WATCH = FileWatch()


def _name_process(name: bytes) -> None:
    """Best effort: show the watcher as `name` in ps/top (what prctl PR_SET_NAME does,
    without importing ctypes: ~10 ms of CPU on a core the handoff may need)."""
    with contextlib.suppress(OSError):
        from dynamo_ftctl.safefiles import open_proc_self

        fd = open_proc_self("comm")
        try:
            os.write(fd, name)
        finally:
            os.close(fd)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"ftctl lock: {line}\n".encode())


def _wait_exit(holder: int, pidfd: int, timeout: float,
               events: InodeEvents | None = None) -> bool:
    """True once `holder` (our parent) has exited, waiting at most `timeout` s, or less
    when `events` says something happened to the lock file (drained here)."""
    poller = select.poll()
    if pidfd >= 0:
        poller.register(pidfd, select.POLLIN)
    if events is not None:
        poller.register(events.fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while True:
        if pidfd < 0 and os.getppid() != holder:  # no pidfd (Linux < 5.3): reparenting
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        step = left if pidfd >= 0 else min(0.05, left)
        ready = {fd for fd, _ in poller.poll(max(0, math.ceil(step * 1000)))}
        if pidfd in ready:
            return True
        if events is not None and events.fd in ready and events.drain():
            return False


def _signal(holder: int, pidfd: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(holder, signum)


def _watch_holder(path: Path, locked: FileIdentity, holder: int, pidfd: int, *,
                  interval_s: float, grace_s: float, token: int,
                  events: InodeEvents | None = None) -> None:
    """The watcher process: until `holder` exits, check the lock file (every `interval_s`
    and whenever `events` wakes it); when it is gone, SIGTERM the holder, then SIGKILL it
    after `grace_s`."""
    if events is not None and not events.watch_file(path):
        events = None  # (gone already: the first check says so) poll
    while True:
        reason = lock_file_gone(path, locked)
        if reason is None:
            if _wait_exit(holder, pidfd, interval_s, events):
                return
            continue
        _say(f"{path} was {reason} while pid {holder} held its lock (token {token}): "
             "the lock is no longer exclusive (the next engine runs once this one is "
             f"stopped, with a higher token); sending SIGTERM to pid {holder}")
        _signal(holder, pidfd, signal.SIGTERM)
        if not _wait_exit(holder, pidfd, grace_s):
            _say(f"pid {holder} still running {grace_s:g} s after SIGTERM: sending SIGKILL")
            _signal(holder, pidfd, signal.SIGKILL)
        return


class PendingWatcher:
    """A watcher process started before the wait for the lock, not yet told what to watch.

    Started while the holder still runs, it leaves the handoff one write to its pipe
    (`arm`). Until then the watcher blocks reading the pipe; when this process exits or
    execs without arming it (the pipe's write end is close-on-exec), it reads
    end-of-file and exits.
    """

    def __init__(self, pid: int, pipe: int) -> None:
        self.pid = pid
        self._pipe = pipe

    def arm(self, lock_fd: int, token: int) -> None:
        """Watch the inode locked through `lock_fd`, held with `token` (one write)."""
        locked = FileIdentity.of_fd(lock_fd)
        os.write(self._pipe, b"%d %d %d\n" % (locked.dev, locked.ino, token))
        os.close(self._pipe)
        self._pipe = -1

    def stop(self) -> None:
        """The command never ran: end the (armed) watcher now and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.cancel()

    def cancel(self) -> None:
        """No lock to watch: the watcher exits; reap it."""
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


# Where the watcher finds its pipe and the holder's pidfd (`prepare_watcher`).
_PIPE_FD, _PIDFD_FD = 3, 4
_WATCHER = "from dynamo_ftctl.lock.watch import watcher_main; watcher_main()"


def prepare_watcher(path: Path, *, interval_s: float, grace_s: float) -> PendingWatcher:
    """Start the watcher of the lock this process is about to take (see `PendingWatcher`).

    A new interpreter started with posix_spawn (vfork and exec), not a fork: a forked
    copy would share this process's memory copy-on-write, and the handoff would then pay
    a page fault for each page it touches between the grant and the exec
    (docs/benchmarks.md, "lock.py"). The watcher holds no lock (it closes every
    descriptor but stdio, its pipe and the holder's pidfd) and, once armed, exits when
    this process (or the program it became) does. It is a child of the command: it exits
    only once the command has, so the command never reaps it while running.
    """
    holder = os.getpid()
    try:
        pidfd = os.pidfd_open(holder)
    except (AttributeError, OSError):
        pidfd = -1
    readable, writable = os.pipe()  # both close-on-exec
    # Above the descriptors they are copied to, so no copy clobbers another's source.
    sources = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (readable, pidfd)
               if fd >= 0]
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
               *((os.POSIX_SPAWN_DUP2, fd, target)
                 for fd, target in zip(sources, (_PIPE_FD, _PIDFD_FD), strict=False))]
    argv = [sys.executable, "-c", _WATCHER, str(path), str(holder), str(int(pidfd >= 0)),
            repr(interval_s), repr(grace_s)]
    ignore = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
    try:  # Ctrl-C is for the command: an ignored SIGINT stays ignored across exec
        pid = os.posix_spawn(sys.executable, argv, os.environ, file_actions=actions)
    except BaseException:
        os.close(writable)
        raise
    finally:
        if ignore:
            signal.signal(signal.SIGINT, previous)
        for fd in (readable, pidfd, *sources):
            if fd >= 0:
                os.close(fd)
    return PendingWatcher(pid, writable)


def watcher_main() -> None:
    """The watcher process (`prepare_watcher`): wait to be armed, then watch; never
    returns."""
    try:
        path, holder, has_pidfd = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
        interval_s, grace_s = float(sys.argv[4]), float(sys.argv[5])
        pidfd = _PIDFD_FD if has_pidfd else -1
        os.closerange(_PIDFD_FD + 1, os.sysconf("SC_OPEN_MAX"))  # inherited ones too
        _name_process(b"ftctl-lockwatch")
        # Before the grant, while the old holder still runs: ctypes costs ~10 ms of CPU.
        from dynamo_ftctl.lock.inotify import InodeEvents

        events = InodeEvents.for_directory(path.parent)
        order = _read_order(_PIPE_FD)
        if order is not None:
            locked, token = order
            _watch_holder(path, locked, holder, pidfd, interval_s=interval_s,
                          grace_s=grace_s, token=token, events=events)
    finally:
        os._exit(0)


def _read_order(pipe: int) -> tuple[FileIdentity, int] | None:
    """What `PendingWatcher.arm` wrote, None at end-of-file (nothing to watch)."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = os.read(pipe, 128)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not chunk:
            return None
        data += chunk
    dev, ino, token = (int(field) for field in data.split())
    return FileIdentity(dev, ino), token


def spawn_watcher(path: Path, lock_fd: int, *, token: int, interval_s: float,
                  grace_s: float) -> int:
    """Start a watcher of the lock held through `lock_fd` for this process and whatever it
    execs next, armed at once; its pid (`prepare_watcher`, for a lock not yet held)."""
    watcher = prepare_watcher(path, interval_s=interval_s, grace_s=grace_s)
    watcher.arm(lock_fd, token)
    return watcher.pid
