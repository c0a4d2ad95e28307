"""The proxy across cores (`ftctl proxy --procs N`): a parent that forks N serving children.

Each child is a whole proxy (`proxy/serve.py`) with its own event loop, listening
on the same port with SO_REUSEPORT: the kernel spreads new connections over the
children (a hash of the connection's addresses), with no accept lock and no
thundering herd, which one listening socket shared by N event loops has. The
parent serves nothing; it

- reserves the port (a socket bound with SO_REUSEPORT, never listening, so it gets
  no connections) and keeps it until the end, so port 0 works and a restarted
  child finds the port free of strangers;
- makes the `FleetBoard` (`proxy/board.py`), one shared mapping the children post
  their request outcomes and loads on, before it forks (no file, no server);
- makes the `PROMETHEUS_MULTIPROC_DIR` of their metrics (`dynamo_ftctl.metrics`) and
  removes it at the end: /metrics from any child is the sum of all;
- waits, with every signal it cares for blocked, in `sigwaitinfo`: SIGTERM or SIGINT
  is sent on to every child, which stops like a single proxy does (answers in
  flight finish within the shutdown deadline), and is SIGKILLed past it plus a
  second; a child that ends on its own is restarted, unless it ended within
  `_MIN_UPTIME_S` of its start (a crash at start-up repeats forever): then the
  parent stops the others and raises `ChildCrashed` (exit 1).

A child that dies takes the connections waiting in its own accept queue with it: the
kernel resets them, unless `net.ipv4.tcp_migrate_req` is 1 (Linux 5.14+), which hands
them to another listener of the port. Connections it had accepted end with it too.

Forked, not spawned (`dynamo_ftctl.process.SPAWNER`): a child inherits the loaded
inventory, the board's mapping and the reserved port as they are, and starts in
milliseconds rather than the ~0.3 s of a new interpreter, which a restart after a
crash waits. The parent forks before it starts any thread or event loop, and each
child dies with it (PDEATHSIG), so a SIGKILLed parent leaves no orphan.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from dynamo_ftctl.process import ForkedChild
from dynamo_ftctl.proxy.board import FleetBoard
from dynamo_ftctl.proxy.errors import ChildCrashed

__all__ = ["ChildCrashed", "ChildRun", "ProcsResult", "reserve_port", "serve_procs"]

# prometheus_client's variable (not imported from `metrics`: the parent must not load
# prometheus_client's metrics before it is set; each child loads them afresh).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP}
_MIN_UPTIME_S = 1.0  # a child that dies sooner is crashing at start-up: not restarted
_READY_TIMEOUT_S = 60.0  # a child that does not listen in this long has failed to start
_PR_SET_PDEATHSIG = 1  # prctl(2)
_KILL_GRACE_S = 1.0  # past the shutdown deadline: the child's own hurry, then SIGKILL


@dataclass(frozen=True)
class ChildRun:
    """What a child gets: its row on the board, the port, and how to say it is ready."""

    index: int
    port: int
    board: FleetBoard
    ready: Callable[[], None]


@dataclass(frozen=True)
class ProcsResult:
    """How the children went: the signal that stopped them and the restarts done."""

    signum: int
    restarts: int


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` with SO_REUSEPORT, not listening (port 0: a free one).

    The port is first bound without SO_REUSEPORT, which fails while any socket holds
    it: otherwise a second `--procs` proxy on the same port would quietly share its
    connections with the first.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Children:
    """The forked children by their board row, and how to make, restart and stop them."""

    def __init__(self, port: int, board: FleetBoard, run: Callable[[ChildRun], int],
                 close_in_child: list[int], mask: set[int | signal.Signals]) -> None:
        self.port = port
        self.mask = mask
        self.board = board
        self.run = run
        self.close_in_child = close_in_child
        self.alive: dict[int, tuple[ForkedChild, float]] = {}
        self.ready_r, self.ready_w = os.pipe()
        self.prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork

    def fork(self, index: int) -> None:
        pid = os.fork()
        if pid:
            self.alive[index] = (ForkedChild(pid), time.monotonic())
            return
        code = 1
        try:  # the child: never returns into the parent's stack
            self.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # A group of its own: a terminal's Ctrl-C reaches the parent only, which sends
            # it on once (a second SIGINT or SIGTERM makes a proxy cut answers short).
            os.setpgid(0, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
            for fd in (*self.close_in_child, self.ready_r):
                os.close(fd)
            _fresh_metrics()
            code = self.run(ChildRun(index, self.port, self.board.as_process(index),
                                     self._say_ready))
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # reported, then the child ends
            import traceback

            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)

    def _say_ready(self) -> None:
        os.write(self.ready_w, b"r")

    def wait_ready(self, count: int) -> None:
        """Wait until `count` children said they listen; ChildCrashed when one died first."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        got = 0
        while got < count:
            left = deadline - time.monotonic()
            dead = [i for i, (child, _) in self.alive.items() if child.poll() is not None]
            if dead or left <= 0:
                msg = f"proxy child {dead[0] if dead else '?'} did not start (see its log above)"
                raise ChildCrashed(msg)
            import select

            readable, _, _ = select.select([self.ready_r], [], [], min(left, 0.2))
            if readable:
                got += len(os.read(self.ready_r, count - got))

    def ended(self) -> list[tuple[int, int, float, int]]:
        """(index, exit status, uptime, pid) of each child that has ended, collected."""
        out = []
        for index, (child, started) in list(self.alive.items()):
            code = child.poll()
            if code is not None:
                del self.alive[index]
                out.append((index, code, time.monotonic() - started, child.pid))
        return out

    def forward(self, signum: int) -> None:
        """`signum` to every child, waiting for none."""
        for child, _ in self.alive.values():
            child.signal(signum)

    def stop(self, signum: int, deadline_s: float) -> None:
        """`signum` to every child, once, then SIGKILL to those alive past `deadline_s`.

        Not `Child.stop`, which sends SIGTERM again: a proxy takes a second signal
        as "hurry" and cancels the answers it was letting finish.
        """
        for child, _ in self.alive.values():
            child.signal(signum)
        end = time.monotonic() + deadline_s
        for child, _ in self.alive.values():
            if child.wait(max(0.0, end - time.monotonic())) is None:
                child.kill()
        self.alive.clear()

    def close(self) -> None:
        os.close(self.ready_r)
        os.close(self.ready_w)


def serve_procs(procs: int, host: str, port: int, workers: list[str],
                run: Callable[[ChildRun], int], *, on_ready: Callable[[int], None],
                shutdown_deadline_s: float) -> ProcsResult:
    """Fork `procs` children that each `run` a proxy on `host:port`; return on a signal.

    `on_ready(port)` once every child listens. OSError when the port cannot be had.
    """
    reserved = reserve_port(host, port)
    port = reserved.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="ftctl-proxy-metrics-")
    previous_dir = os.environ.get(MULTIPROC_DIR_ENV)
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir
    board = FleetBoard(procs, workers)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    children = _Children(port, board, run, [reserved.fileno()], old_mask)
    restarts = 0
    try:
        for index in range(procs):
            children.fork(index)
        children.wait_ready(procs)
        on_ready(port)
        while True:
            info = signal.sigwaitinfo(_SIGNALS)
            if info.si_signo == signal.SIGHUP:  # each child reloads the inventory itself
                children.forward(signal.SIGHUP)
                continue
            if info.si_signo != signal.SIGCHLD:
                children.stop(info.si_signo, shutdown_deadline_s + _KILL_GRACE_S)
                return ProcsResult(signum=info.si_signo, restarts=restarts)
            for index, code, uptime, pid in children.ended():
                _forget_process(metrics_dir, board, index, pid)
                if uptime < _MIN_UPTIME_S:
                    children.stop(signal.SIGTERM, shutdown_deadline_s + _KILL_GRACE_S)
                    msg = (f"proxy child {index} ended with status {code} {uptime:.1f} s "
                           "after its start: not restarted")
                    raise ChildCrashed(msg)
                restarts += 1
                children.fork(index)
    finally:
        if children.alive:
            children.stop(signal.SIGTERM, shutdown_deadline_s + _KILL_GRACE_S)
        children.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if previous_dir is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous_dir


def _forget_process(metrics_dir: str, board: FleetBoard, index: int, pid: int) -> None:
    """A dead child's `live*` gauges leave the exposition; its load leaves the board."""
    from prometheus_client import multiprocess

    board.clear_row(index)
    multiprocess.mark_process_dead(pid, metrics_dir)  # type: ignore[no-untyped-call]


def _fresh_metrics() -> None:
    """In a child: define the metrics anew in multiprocess mode if the parent had them."""
    import sys

    module = sys.modules.get("dynamo_ftctl.metrics")
    if module is not None:
        import importlib

        importlib.reload(module)
