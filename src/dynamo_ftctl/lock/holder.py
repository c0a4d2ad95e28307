"""Hold a failover lock for exactly the life of a command (`ftctl lock acquire -- CMD`).

With flock, the locked descriptor is made inheritable and this process execs
the command (like `flock(1)`): the lock lives until the command's last copy of
the descriptor closes, with no supervisor in between. A watcher forked before
the wait (`watch.prepare_watcher`, which holds no lock) checks the lock file meanwhile and,
when it is deleted or replaced, sends the command SIGTERM with one line on
stderr, then SIGKILL after the grace (`$FTCTL_LOCK_TERM_GRACE`, 5 s); the command's
exit status is then its own (143 for a default SIGTERM), since ftctl has become the
command. The next holder of a new lock file waits out that bound (`bound.py`).

With etcd, a lease needs a keep-alive, so the command runs as a child and is
killed the same way (SIGTERM, SIGKILL after `TERM_GRACE_S`) if the lease is lost,
and ftctl exits 5 (`LeaseLost`); meanwhile this process passes the signals a
supervisor sends (SIGTERM from Kubernetes, SIGHUP, SIGQUIT, SIGUSR1/2, SIGINT)
on to the command, as tini does, and exits with the command's status (128+N
when a signal ended it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import InvalidInput, LeaseLost
from dynamo_ftctl.lock.bound import TERM_GRACE_S, WATCH_INTERVAL_S, stop_bound_s
from dynamo_ftctl.lock.flock import FlockLock
from dynamo_ftctl.lock.protocol import FailoverLock, Lease
from dynamo_ftctl.lock.settings import LockSettings, open_lock
from dynamo_ftctl.lock.watch import prepare_watcher

if TYPE_CHECKING:
    # Loaded by `run_holding` only: the exec form stays small (it execs faster).
    from dynamo_ftctl.process import Child, Spawner

__all__ = [
    "LOCK_FD_ENV", "LOCK_TOKEN_ENV", "TERM_GRACE_S", "exec_holding", "hold_for_command",
    "run_holding",
]

# The command learns which descriptor holds the lock and its fencing token.
LOCK_FD_ENV = "FTCTL_LOCK_FD"
LOCK_TOKEN_ENV = "FTCTL_LOCK_TOKEN"  # noqa: S105 (a fencing token, not a secret)
# What a supervised command is sent on when this process receives it.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGINT)


@contextmanager
def _forwarding_signals(children: list[Child]) -> Iterator[list[int]]:
    """Pass FORWARDED_SIGNALS on to `children` while the block runs (main thread only).

    Yields the signals that arrived before any child existed: the caller sends
    them to the child it starts, so a SIGTERM during start-up is not lost.
    """
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return

    def forward(signum: int, _frame: object) -> None:
        if not children:
            pending.append(signum)
        for child in children:
            child.signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_command(argv: Sequence[str]) -> None:
    if not argv:
        msg = "no command to run"
        raise InvalidInput(msg)


def _find_program(name: str, env: dict[str, str]) -> str | None:
    """Where execvpe would find `name`, searched before the wait, not after the grant
    (execvpe tries one directory per execve); None: let execvpe say why it fails. (Not
    shutil.which: shutil loads bz2, lzma and zlib, and a bigger process execs slower.)"""
    if os.sep in name:
        return name
    for directory in os.get_exec_path(env):
        candidate = Path(directory) / name
        if os.access(candidate, os.X_OK) and not candidate.is_dir():
            return str(candidate)
    return None


def exec_holding(lock: FlockLock, argv: Sequence[str], timeout: float | None = None, *,
                 watch_interval_s: float = WATCH_INTERVAL_S,
                 term_grace_s: float = TERM_GRACE_S) -> None:
    """Acquire `lock`, then replace this process with `argv`, the descriptor inherited.

    With `watch_interval_s` > 0 a watcher process checks the lock file at that
    interval and stops the command (SIGTERM, SIGKILL `term_grace_s` later) once
    it is deleted or replaced. `lock` itself must not watch (a thread would not
    survive the exec). Returns only by raising: `LockTimeout`, or `InvalidInput`
    when the command cannot be executed (the lock is released then).

    Everything but the token is done before the wait, so that between the grant and
    the exec there is only the owner record (no fsync: the token was reserved, see
    `flock.py`) and one write to the watcher: the watcher is forked and the
    environment copied first, and the wait is a flock(2) in this thread.
    """
    _check_command(argv)
    env = dict(os.environ)
    program = _find_program(argv[0], env)
    watcher = None
    if watch_interval_s > 0:
        try:
            watcher = prepare_watcher(lock.path, interval_s=watch_interval_s,
                                      grace_s=term_grace_s)
        except OSError as exc:  # no process left (EAGAIN): run unwatched, as flock(1) does
            sys.stderr.write(f"ftctl lock: cannot start the lock file watcher "
                             f"({exc.strerror}): {argv[0]!r} runs unwatched\n")
    try:
        lease = lock.acquire_here(timeout)
    except BaseException:
        if watcher is not None:
            watcher.cancel()
        raise
    assert lease.fd is not None
    os.set_inheritable(lease.fd, True)
    env[LOCK_FD_ENV], env[LOCK_TOKEN_ENV] = str(lease.fd), str(lease.token)
    if watcher is not None:
        watcher.arm(lease.fd, lease.token)
    try:
        if program is not None:
            with contextlib.suppress(OSError):  # gone meanwhile: execvpe says why
                os.execve(program, list(argv), env)  # noqa: S606 (exec is the point)
        os.execvpe(argv[0], list(argv), env)  # noqa: S606 (exec is the point, like flock(1))
    except OSError as exc:
        if watcher is not None:
            watcher.stop()
        lock.release()
        msg = f"cannot run {argv[0]!r}: {exc.strerror}"
        raise InvalidInput(msg) from exc


def run_holding(lock: FailoverLock, argv: Sequence[str], timeout: float | None = None, *,
                spawner: Spawner | None = None) -> int:
    """Acquire `lock`, run `argv` as a child while holding it, release; the child's exit code.

    A lock lost while the child runs (etcd lease, flock file deleted or replaced)
    terminates the child (SIGTERM, then SIGKILL after the lock's `term_grace_s`, else
    `TERM_GRACE_S`) and raises `LeaseLost`. `spawner`: `process.SPAWNER` unless given.
    """
    _check_command(argv)
    grace_s = getattr(lock, "term_grace_s", TERM_GRACE_S)
    if spawner is None:
        from dynamo_ftctl.process import SPAWNER

        spawner = SPAWNER
    lost = threading.Event()
    why: list[LeaseLost] = []

    def tell(exc: LeaseLost) -> None:
        why.append(exc)
        lost.set()

    lock.set_on_lost(tell)
    lease: Lease = lock.acquire(timeout)
    env = {**os.environ, LOCK_TOKEN_ENV: str(lease.token)}
    children: list[Child] = []
    try:
        with _forwarding_signals(children) as pending:
            try:
                # Every stream inherited, stdin too: the command is the holder's foreground.
                child = spawner.spawn(argv, env=env, stdin=None)
            except OSError as exc:
                msg = f"cannot run {argv[0]!r}: {exc.strerror}"
                raise InvalidInput(msg) from exc
            children.append(child)
            for signum in pending:
                child.signal(signum)

            def reap() -> None:
                child.wait()
                lost.set()

            threading.Thread(target=reap, daemon=True).start()
            lost.wait()
        if child.poll() is None:
            child.stop(grace_s)
            reason = str(why[0]) if why else f"{lock.name}: lease lost"
            msg = f"{reason}; stopped {argv[0]!r}"
            raise LeaseLost(msg)
        # A command ended by signal N exits 128+N, as a shell reports it.
        code = child.wait_for_exit()
        return code if code >= 0 else 128 - code
    finally:
        lock.release()


def hold_for_command(settings: LockSettings, argv: Sequence[str],
                     timeout: float | None = None) -> int:
    """`ftctl lock acquire -- CMD`: exec CMD holding a flock, or supervise it holding etcd."""
    if settings.backend == "flock":
        assert settings.path is not None
        # The lock itself does not watch (its thread would not survive the exec), but it
        # settles a new lock file for the bound the watcher process keeps.
        bound = stop_bound_s(settings.watch_interval_s, settings.term_grace_s)
        exec_holding(FlockLock(settings.path, settings.engine_id, watch_interval_s=0,
                               term_grace_s=settings.term_grace_s, settle_s=bound),
                     argv, timeout, watch_interval_s=settings.watch_interval_s,
                     term_grace_s=settings.term_grace_s)
    return run_holding(open_lock(settings), argv, timeout)
