"""The one seam for processes: start them, stop them (SIGTERM, SIGKILL by a deadline), tell
whether one still runs.

Callers start processes through a `Spawner` (`SPAWNER`, the real one, or a
`FakeSpawner` in unit tests, which records spawns and signals and scripts exits), not
through `subprocess` directly:

- `Spawner.spawn(argv, ...)` -> `Child`: argv, environment, working directory, a process
  group of its own or not, each stream inherited, discarded, piped or sent to a file;
- `Child.stop(deadline_s)`: SIGTERM to the process (or its whole group), a wait of at
  most `deadline_s`, then SIGKILL, and the exit status collected (no zombie left);
- `Spawner.run(argv, timeout_s=...)` and `run_async`: a short command to its end, its
  output captured, killed at the deadline;
- `Identity`: a process this one did not start (a pid file's), known by pid *and* start
  time, so that neither a zombie nor a reused pid passes for it; `Identity.stop` is the
  same TERM-then-KILL for it.

The lock's `ftctl lock acquire -- CMD` execs in place and forks its watcher: an exec is
not a spawn, and the watcher must be a fork (no interpreter start on the handoff path);
`ForkedChild` stops and collects such a fork like any child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from signal import Signals
from typing import IO

from dynamo_ftctl import procfs

__all__ = [
    "DEVNULL", "PIPE", "SPAWNER", "STDOUT", "Child", "FakeChild", "FakeSpawner", "Finished",
    "ForkedChild", "Identity", "Sink", "Spawner", "run_async",
]

DEVNULL = subprocess.DEVNULL
PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT  # for stderr: where stdout goes
# Where a stream goes: inherited (None), DEVNULL, PIPE, STDOUT, a descriptor, an open file,
# or a path (opened for the spawn, appended to or truncated).
Sink = int | IO[bytes] | Path | None
_PR_SET_PDEATHSIG = 1  # prctl(2)
_POLL_S = 0.02  # how often a non-child's end is looked for: there is no wait() for it


@dataclass(frozen=True)
class Finished:
    """A command run to its end (or killed at its deadline: `timed_out`)."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


class Child:
    """A process this one started: signal it (or its group), wait for it, stop it.

    `stop`, `kill` and `alive` are written once over four primitives (`poll`, `wait`,
    `_send`, `pid`) that the real and the fake child each provide.
    """

    pid: int
    group: bool

    def poll(self) -> int | None:
        """The exit status once it has ended (collected: no zombie), else None."""
        raise NotImplementedError

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit status once it ends within `timeout_s` (None: no limit), else None."""
        raise NotImplementedError

    def _send(self, signum: int, *, group: bool) -> None:
        raise NotImplementedError

    def wait_for_exit(self) -> int:
        """Block until the process ends; its exit status."""
        code = self.wait()
        assert code is not None
        return code

    @property
    def stdout(self) -> IO[bytes] | None:
        """The read end of a piped stdout (None: not piped)."""
        return None

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that ended it), None while it runs."""
        return self.poll()

    @property
    def alive(self) -> bool:
        """True while the process has not ended."""
        return self.poll() is None

    def signal(self, signum: int) -> bool:
        """Send `signum` to the process, or to its whole group when it leads one; False
        when there is nobody left to receive it."""
        try:
            self._send(signum, group=self.group)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop(self, deadline_s: float) -> int:
        """SIGTERM (the group: SIGCONT first, a stopped group cannot exit), at most
        `deadline_s` for the end, then SIGKILL; the exit status, collected.

        A group is SIGKILLed after its leader ends too: children it left behind go with it.
        """
        if self.poll() is None:
            if self.group:
                self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            self.wait(deadline_s)
        return self.kill()

    def kill(self) -> int:
        """SIGKILL the process (or its group) and collect its exit status."""
        if self.group:
            self.signal(signal.SIGKILL)  # also members that outlive the leader
        if self.poll() is None:
            self.signal(signal.SIGKILL)
        return self.wait_for_exit()


class OwnsChild:
    """A process this one started and keeps as `child`: its pid and liveness by delegation
    (the sim launcher's `SimWorker`, the drill's `CommandWorker`)."""

    child: Child

    @property
    def pid(self) -> int:
        """The process id (also its group id when it leads one)."""
        return self.child.pid

    @property
    def alive(self) -> bool:
        """True while the process has not ended."""
        return self.child.alive


class _PopenChild(Child):
    """A real child, over `subprocess.Popen`."""

    def __init__(self, popen: subprocess.Popen[bytes], *, group: bool,
                 on_end: Callable[[int], None]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.group = group
        self._on_end = on_end

    @property
    def stdout(self) -> IO[bytes] | None:
        return self.popen.stdout

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None:
            self._on_end(self.pid)
        return code

    def wait(self, timeout_s: float | None = None) -> int | None:
        try:
            code = self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self._on_end(self.pid)
        return code

    def _send(self, signum: int, *, group: bool) -> None:
        if group:
            # kill(-pgid) reaches every member (POSIX kill(2)); the leader's pid is the pgid.
            os.killpg(self.pid, signum)
        elif self.popen.poll() is None:  # Popen: never signal a pid already collected
            self.popen.send_signal(signum)
        else:
            raise ProcessLookupError


class ForkedChild(Child):
    """A child made by a bare `os.fork()` (the lock's watcher: no interpreter start on the
    handoff path), stopped and collected like any other."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.group = False
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            self._collect(os.WNOHANG)
        return self._code

    def wait(self, timeout_s: float | None = None) -> int | None:
        if timeout_s is None:
            if self._code is None:
                self._collect(0)
            return self._code
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # no waitpid with a timeout: polled with a deadline
        return self._code

    def _collect(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # collected elsewhere: its status is lost
            self._code = 0
            return
        if pid:
            self._code = os.waitstatus_to_exitcode(status)

    def _send(self, signum: int, *, group: bool) -> None:
        del group
        if self.poll() is not None:
            raise ProcessLookupError
        os.kill(self.pid, signum)


@contextlib.contextmanager
def _opened(sink: Sink, append: bool) -> Iterator[int | IO[bytes] | None]:
    if isinstance(sink, Path):
        from dynamo_ftctl.safefiles import open_sink

        with open_sink(sink, append=append) as handle:
            yield handle
    else:
        yield sink


def _die_with_parent() -> Callable[[], None]:
    import ctypes

    # Looked up here, in the parent: the child only makes the call (no dlopen after fork,
    # where another thread may have held the loader's lock).
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        """In the child: SIGKILL when the forking thread dies."""
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return arm


class Spawner:
    """Starts real processes and keeps those it started until their end is collected (so
    a `reap` by pid, from code that kept only the pid, leaves no zombie and no warning)."""

    def __init__(self) -> None:
        self._children: dict[int, _PopenChild] = {}

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        cwd: Path | None = None, group: bool = False, stdin: int | IO[bytes] | None = DEVNULL,
        stdout: Sink = None, stderr: Sink = None, append: bool = False,
        die_with_parent: bool = False,
    ) -> Child:
        """Start `argv`; `group`: in a session (so a process group) of its own; a path as
        `stdout`/`stderr`: that file (`append` or truncated; both the same path: opened
        once); `die_with_parent`: SIGKILLed when the calling thread dies (Linux
        PDEATHSIG). OSError when it cannot start."""
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(_opened(stdout, append))
            same_file = isinstance(stderr, Path) and stderr == stdout
            err = STDOUT if same_file else stack.enter_context(_opened(stderr, append))
            popen = subprocess.Popen(
                list(argv), stdin=stdin, stdout=out, stderr=err, cwd=cwd,
                env=None if env is None else dict(env), start_new_session=group,
                preexec_fn=_die_with_parent() if die_with_parent else None)  # noqa: PLW1509
        child = _PopenChild(popen, group=group, on_end=self._forget)
        self._children[child.pid] = child
        return child

    def _forget(self, pid: int) -> None:
        self._children.pop(pid, None)

    def reap(self, pid: int) -> None:
        """Collect the end of `pid` if it was a child of ours that has ended (no zombie)."""
        child = self._children.get(pid)
        if child is not None:
            child.poll()
            return
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)

    def run(self, argv: Sequence[str], *, timeout_s: float,
            env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Finished:
        """Run `argv` to its end, output captured; killed (and `timed_out`) at `timeout_s`.
        OSError when it cannot start."""
        try:
            done = subprocess.run(
                list(argv), capture_output=True, text=True, errors="replace",
                timeout=timeout_s, check=False, cwd=cwd,
                env=None if env is None else dict(env))
        except subprocess.TimeoutExpired as exc:
            return Finished(tuple(argv), -signal.SIGKILL, _text(exc.stdout), _text(exc.stderr),
                            timed_out=True)
        return Finished(tuple(argv), done.returncode, done.stdout, done.stderr)


def _text(raw: bytes | str | None) -> str:
    if isinstance(raw, bytes):
        return raw.decode(errors="replace")
    return raw or ""


async def run_async(argv: Sequence[str], *, timeout_s: float,
                    env: Mapping[str, str] | None = None) -> Finished:
    """`Spawner.run` for asyncio callers: stdout discarded, stderr captured, killed and
    reaped at `timeout_s`. OSError when it cannot start."""
    import asyncio  # late: the lock's start-up never needs it
    proc = await asyncio.create_subprocess_exec(
        *argv, env=None if env is None else dict(env), stdin=DEVNULL, stdout=DEVNULL,
        stderr=PIPE)
    try:
        async with asyncio.timeout(timeout_s):
            _, err = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return Finished(tuple(argv), -signal.SIGKILL, "", "", timed_out=True)
    assert proc.returncode is not None
    return Finished(tuple(argv), proc.returncode, "", _text(err))


SPAWNER = Spawner()


# ---------------------------------------------------------------------------
# Processes this one did not start


@dataclass(frozen=True)
class Identity:
    """A process known by pid and start time (clock ticks since boot, from /proc): a
    zombie, or another process that got the pid later, is not it."""

    pid: int
    started: str

    @classmethod
    def of(cls, pid: int, *, marker: bytes | None = None) -> Identity | None:
        """The live (not zombie) process `pid`, whose arguments hold `marker` if one is
        given; None when there is no such process."""
        state = procfs.stat(pid)
        if state is None or state[0] == "Z":
            return None
        if marker is not None and marker not in b"\0".join(procfs.cmdline(pid) or ()):
            return None
        return cls(pid, state[1])

    @property
    def alive(self) -> bool:
        """True until this process is a zombie or gone (its pid reused is gone).

        Not by its arguments: they read empty while an exiting process tears down
        (memory gone, sockets not yet closed), and such a process has not ended.
        """
        state = procfs.stat(self.pid)
        return state is not None and state[0] != "Z" and state[1] == self.started

    def signal(self, signum: int, *, kill: Callable[[int, int], None] = os.kill) -> bool:
        """Send `signum` while it is still this process; False when it is not."""
        if not self.alive:
            return False
        try:
            kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def wait_gone(self, deadline: float) -> bool:
        """True once it has ended, polling until `deadline` (time.monotonic())."""
        while self.alive:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)  # a condition polled with a deadline (not our child)
        return True

    def stop(self, deadline_s: float, *, kill_wait_s: float | None = None,
             kill: Callable[[int, int], None] = os.kill) -> Signals | None:
        """SIGTERM, at most `deadline_s` for the end, then SIGKILL and at most
        `kill_wait_s` (default: `deadline_s`) more; the signal after which it had
        ended, or None when it still runs."""
        waits = (deadline_s, deadline_s if kill_wait_s is None else kill_wait_s)
        for signum, wait_s in zip((signal.SIGTERM, signal.SIGKILL), waits, strict=True):
            self.signal(signum, kill=kill)
            if self.wait_gone(time.monotonic() + wait_s):
                return signum
        return None


# ---------------------------------------------------------------------------
# The fake, for unit tests of callers


class FakeChild(Child):
    """A scripted child: records the signals it gets; `exits_on` maps a signal to the exit
    status it ends with (default: SIGTERM and SIGKILL end it, as the signal); `finish`
    ends it from the test. No time passes: a `wait` on a live fake returns at once."""

    def __init__(self, pid: int, argv: Sequence[str], *, group: bool,
                 exits_on: Mapping[int, int] | None = None, stdout: Sink = None,
                 stderr: Sink = None, env: Mapping[str, str] | None = None,
                 journal: list[tuple[int, int]] | None = None) -> None:
        self.pid = pid
        self.argv = list(argv)
        self.group = group
        self.env = dict(env or {})
        self.stdout_sink = stdout
        self.stderr_sink = stderr
        self.exits_on: dict[int, int] = dict(exits_on if exits_on is not None else
                             {signal.SIGTERM: -signal.SIGTERM, signal.SIGKILL: -signal.SIGKILL})
        self.exits_on.setdefault(signal.SIGKILL, -signal.SIGKILL)  # nobody ignores it
        self.signals: list[tuple[int, bool]] = []  # (signal, to the group)
        self.waits: list[float | None] = []
        self.code: int | None = None
        self._journal = journal if journal is not None else []

    @property
    def sent(self) -> list[int]:
        """The signals received, in order."""
        return [signum for signum, _ in self.signals]

    def finish(self, code: int) -> None:
        """End the process with exit status `code`."""
        if self.code is None:
            self.code = code

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout_s: float | None = None) -> int | None:
        self.waits.append(timeout_s)
        if self.code is None and timeout_s is None:
            msg = f"wait() on fake pid {self.pid}, which never ends: script its exit"
            raise AssertionError(msg)
        return self.code

    def _send(self, signum: int, *, group: bool) -> None:
        if self.code is not None and not group:
            raise ProcessLookupError
        self.signals.append((signum, group))
        self._journal.append((self.pid, signum))
        if signum in self.exits_on:
            self.finish(self.exits_on[signum])


@dataclass
class FakeSpawner(Spawner):
    """A `Spawner` that starts nothing: `spawned` lists the children it made (each a
    `FakeChild` with `exits_on`), `signals` every (pid, signal) sent to any of them in
    order, `runs` the commands `run` was asked for, answered by `answer` (default: exit 0,
    no output); `fail` makes the next spawn raise it."""

    exits_on: Mapping[int, int] | None = None
    answer: Callable[[Sequence[str]], Finished] | None = None
    fail: OSError | None = None
    spawned: list[FakeChild] = field(default_factory=list)
    signals: list[tuple[int, int]] = field(default_factory=list)
    runs: list[list[str]] = field(default_factory=list)
    next_pid: int = 40000

    def __post_init__(self) -> None:
        Spawner.__init__(self)

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        cwd: Path | None = None, group: bool = False, stdin: int | IO[bytes] | None = DEVNULL,
        stdout: Sink = None, stderr: Sink = None, append: bool = False,
        die_with_parent: bool = False,
    ) -> FakeChild:
        del cwd, stdin, append, die_with_parent
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        self.next_pid += 1
        child = FakeChild(self.next_pid, argv, group=group, exits_on=self.exits_on,
                          stdout=stdout, stderr=stderr, env=env, journal=self.signals)
        self.spawned.append(child)
        return child

    def reap(self, pid: int) -> None:
        del pid

    def run(self, argv: Sequence[str], *, timeout_s: float,
            env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Finished:
        del timeout_s, env, cwd
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        self.runs.append(list(argv))
        return self.answer(argv) if self.answer else Finished(tuple(argv), 0, "", "")
