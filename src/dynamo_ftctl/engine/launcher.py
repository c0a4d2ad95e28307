"""Start `ftctl sim` engines as processes: one worker, or every `launch.sim` worker of an inventory.

This is the one process spawner of the engine (tests, drills and
`ftctl sim cluster` use it). Each worker runs `python -m dynamo_ftctl sim
serve ...` in its own process group, writes a pid file, and prints its URL on
stdout once it serves; the launcher waits for that line and for `/health`
with a deadline, and names the worker that did not come up. Stopping is
SIGTERM, then SIGKILL after a bounded wait (`process.Child.stop`). stderr goes to a log file (the
crash fault's Xid line lands there).
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

from dynamo_ftctl import procfs
from dynamo_ftctl.errors import InvalidInput, Unreachable, require_extra
from dynamo_ftctl.process import PIPE, SPAWNER, Child, Identity, OwnsChild
from dynamo_ftctl.safefiles import temp_log

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Inventory, Worker

__all__ = [
    "ClusterStatus",
    "LocalCluster",
    "SimWorker",
    "StopResult",
    "WorkerInfo",
    "cluster_pid_file",
    "default_state_dir",
    "run_cluster",
    "start_cluster",
    "start_worker",
    "stop_cluster",
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class SimWorker(OwnsChild):
    """One running engine process: its URL, pid, pid file and stderr log."""

    def __init__(  # noqa: PLR0917 (built in one place, by `_spawn`)
        self, name: str, child: Child, log_path: Path,
        pid_file: Path | None, admin_token: str | None, own_log: bool,
    ) -> None:
        self.name = name
        self.child = child
        self.log_path = log_path
        self.pid_file = pid_file
        self.admin_token = admin_token
        self.url = ""
        self._own_log = own_log

    def stderr_text(self) -> str:
        """Everything the engine wrote on stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code once the process ends within `timeout_s`, else None."""
        return self.child.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        code = self.child.stop(timeout_s)
        stdout = self.child.stdout
        if stdout is not None:
            stdout.close()
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return code

    def kill(self) -> None:
        """SIGKILL the engine (a hung engine ignores SIGTERM)."""
        self.child.kill()

    def __enter__(self) -> SimWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_line(stream: IO[bytes], proc: Child, deadline: float) -> str:
    """The first stdout line, waiting until `deadline` or the process's exit."""
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        fd = stream.fileno()
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return ""
            if not selector.select(min(left, 0.5)):
                if proc.poll() is not None:
                    return ""
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""
            buffer += chunk
    return buffer.split(b"\n", 1)[0].decode(errors="replace").strip()


def _health_ok(url: str, timeout_s: float) -> bool:
    from dynamo_ftctl.http1 import fetch_blocking

    try:
        return fetch_blocking("GET", f"{url}/health", timeout_s=timeout_s)[0] == 200
    except OSError:  # http1's HttpError or TimeoutError
        return False


def _spawn(
    name: str, *, port: int, seed: int, model_config: str, args: Sequence[str],
    host: str, pid_file: Path | None, log_path: Path | None, admin_token: str | None,
    admin_token_env: str, env: Mapping[str, str] | None,
) -> SimWorker:
    # The worker runs in this interpreter: without torch it would only fail there, with
    # exit 3 ("did not come up") where the fix is an install (exit 2).
    require_extra("torch")
    own_log = log_path is None
    if log_path is None:
        log_path = temp_log(f"ftctl-sim-{name}-")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if pid_file is not None:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "dynamo_ftctl", "sim", "serve", "--host", host, "--port",
        str(port), "--seed", str(seed), "--model-config", model_config,
        "--admin-token-env", admin_token_env,
    ]
    if pid_file is not None:
        argv += ["--pid-file", str(pid_file)]
    argv += list(args)
    child_env = {**os.environ, **(env or {})}
    if admin_token is not None:
        child_env[admin_token_env] = admin_token
    token = child_env.get(admin_token_env)
    child = SPAWNER.spawn(argv, stdout=PIPE, stderr=log_path, env=child_env, group=True)
    return SimWorker(name, child, log_path, pid_file, token, own_log)


def _await_ready(worker: SimWorker, deadline: float) -> None:
    stdout = worker.child.stdout
    assert stdout is not None
    line = _read_line(stdout, worker.child, deadline)
    if not line.startswith("http"):
        code = worker.child.poll()
        tail = worker.stderr_text().strip().splitlines()[-1:] or ["(no output)"]
        state = f"exited with code {code}" if code is not None else "timed out"
        msg = f"worker {worker.name} did not come up ({state}): {tail[0]}"
        if code is None:
            worker.kill()
        raise Unreachable(msg)
    worker.url = line
    while not _health_ok(worker.url, max(min(deadline - time.monotonic(), 2.0), 0.1)):
        if time.monotonic() > deadline or not worker.alive:
            worker.kill()
            msg = f"worker {worker.name} at {worker.url} did not become healthy in time"
            raise Unreachable(msg)
        # Not a sleep-and-hope: the URL line comes after start-up, so this rarely loops.
        time.sleep(0.05)


def start_worker(
    name: str = "sim", *, port: int = 0, seed: int = 0, model_config: str = "ftctl-sim-tiny",
    args: Sequence[str] = (), host: str = "127.0.0.1", pid_file: Path | None = None,
    log_path: Path | None = None, admin_token: str | None = None,
    admin_token_env: str = "FTCTL_ADMIN_TOKEN",  # noqa: S107 (a variable name, not a secret)
    env: Mapping[str, str] | None = None, timeout_s: float = 60.0,
) -> SimWorker:
    """Start one engine (port 0: a free port) and return it once `/health` answers 200.

    `Unreachable` names the worker when it exits or misses the deadline.
    """
    worker = _spawn(name, port=port, seed=seed, model_config=model_config, args=args,
                    host=host, pid_file=pid_file, log_path=log_path, admin_token=admin_token,
                    admin_token_env=admin_token_env, env=env)
    try:
        _await_ready(worker, time.monotonic() + timeout_s)
    except BaseException:
        worker.stop(timeout_s=2)
        raise
    return worker


# ---------------------------------------------------------------------------
# Clusters from an inventory


@dataclass(frozen=True)
class WorkerInfo:
    """A started worker, for tables and `--json`."""

    name: str
    url: str
    pid: int
    pid_file: str
    log: str


@dataclass(frozen=True)
class ClusterStatus:
    """What `ftctl sim cluster` started."""

    cluster: str
    state_dir: str
    workers: tuple[WorkerInfo, ...]

    def __rich__(self) -> Any:
        from dynamo_ftctl.output import table

        return table(f"cluster {self.cluster} (state in {self.state_dir})",
                     ["worker", "url", "pid", "log"],
                     [(w.name, w.url, w.pid, w.log) for w in self.workers])


def default_state_dir(inventory: Inventory) -> Path:
    """Where pid files and logs go: $FTCTL_STATE_DIR, $XDG_RUNTIME_DIR/ftctl or a temp dir."""
    explicit = os.environ.get("FTCTL_STATE_DIR")
    if explicit:
        return Path(explicit) / inventory.cluster
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "ftctl" if runtime else Path(tempfile.gettempdir()) / (
        f"ftctl-{os.getuid()}")
    return base / inventory.cluster


def _sim_workers(inventory: Inventory) -> list[Worker]:
    workers = [w for w in inventory.workers if w.launch is not None and w.launch.sim is not None]
    if not workers:
        where = f"{inventory.source}: " if inventory.source else ""
        msg = f"{where}no worker has launch.sim; nothing to start"
        raise InvalidInput(msg)
    return workers


def cluster_pid_file(inventory: Inventory, worker: Worker,
                     state_dir: Path | None = None) -> Path | None:
    """Where `ftctl sim cluster` keeps `worker`'s pid: the inventory's `process.pid_file`
    when it names one, else `<state dir>/<worker>.pid` for a `launch.sim` worker
    (`state_dir`, default `default_state_dir`); None for a worker the cluster does not start.
    `ftctl inject` reads the same file (faults/plan.py)."""
    if worker.process is not None and worker.process.pid_file is not None:
        return inventory.resolve(worker.process.pid_file)
    if worker.launch is None or worker.launch.sim is None:
        return None
    return (state_dir or default_state_dir(inventory)) / f"{worker.name}.pid"


def _pid_file(inventory: Inventory, worker: Worker, state_dir: Path) -> Path:
    path = cluster_pid_file(inventory, worker, state_dir)
    assert path is not None  # only launch.sim workers are started
    return path


def _port_of(worker: Worker) -> tuple[str, int]:
    parts = urlsplit(worker.url)
    host = parts.hostname or "127.0.0.1"
    if host not in _LOOPBACK:
        msg = f"worker {worker.name}: {worker.url} is not a loopback URL; sim runs locally"
        raise InvalidInput(msg)
    if parts.port is None:
        msg = f"worker {worker.name}: {worker.url} needs an explicit port"
        raise InvalidInput(msg)
    return ("127.0.0.1" if host == "localhost" else host), parts.port


class LocalCluster:
    """The engines of one inventory, started by `start_cluster`; stop them with `stop()`."""

    def __init__(self, inventory: Inventory, state_dir: Path, workers: dict[str, SimWorker]):
        self.inventory = inventory
        self.state_dir = state_dir
        self.workers = workers

    @property
    def status(self) -> ClusterStatus:
        """The started workers as a result object."""
        return ClusterStatus(self.inventory.cluster, str(self.state_dir), tuple(
            WorkerInfo(w.name, w.url, w.pid, str(w.pid_file), str(w.log_path))
            for w in self.workers.values()))

    def __getitem__(self, name: str) -> SimWorker:
        return self.workers[name]

    def __iter__(self) -> Iterator[SimWorker]:
        return iter(self.workers.values())

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (SIGTERM, SIGKILL after `timeout_s`), all at once."""
        for worker in self.workers.values():
            if worker.alive:
                worker.child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for worker in self.workers.values():
            if worker.wait_exit(max(deadline - time.monotonic(), 0.0)) is None:
                worker.kill()
            worker.stop(timeout_s=0)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def start_cluster(
    inventory: Inventory, *, state_dir: Path | None = None, timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> LocalCluster:
    """Start every `launch.sim` worker of `inventory` and wait until all are healthy.

    Workers start in parallel; `Unreachable` names the first one that did not
    come up by the deadline, after stopping all of them.
    """
    state = state_dir or default_state_dir(inventory)
    state.mkdir(parents=True, exist_ok=True)
    started: dict[str, SimWorker] = {}
    cluster = LocalCluster(inventory, state, started)
    try:
        for worker in _sim_workers(inventory):
            assert worker.launch is not None
            assert worker.launch.sim is not None
            host, port = _port_of(worker)
            sim = worker.launch.sim
            warmup = () if sim.warmup_s is None else ("--warmup-s", str(sim.warmup_s))
            token_env = worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"
            started[worker.name] = _spawn(
                worker.name, port=port, seed=sim.seed, model_config=sim.model_config_name,
                args=(*warmup, *sim.args, "--served-model-name", worker.model), host=host,
                pid_file=_pid_file(inventory, worker, state),
                log_path=state / f"{worker.name}.log", admin_token=None,
                admin_token_env=token_env, env=env,
            )
        deadline = time.monotonic() + timeout_s
        for worker_process in started.values():
            _await_ready(worker_process, deadline)
    except BaseException:
        cluster.stop(timeout_s=2)
        raise
    return cluster


def run_cluster(
    inventory: Inventory, *, state_dir: Path | None = None, timeout_s: float = 60.0,
    on_ready: Callable[[ClusterStatus], None] | None = None,
    on_exit: Callable[[str, int], None] | None = None,
) -> ClusterStatus:
    """Start the cluster, call `on_ready`, serve until SIGINT/SIGTERM, then stop it all.

    `on_exit(name, code)` reports a worker that died on its own meanwhile.
    """
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with start_cluster(inventory, state_dir=state_dir, timeout_s=timeout_s) as cluster:
            if on_ready is not None:
                on_ready(cluster.status)
            reported: set[str] = set()
            try:
                while not stop.wait(0.5):
                    for worker in cluster:
                        code = worker.child.poll()
                        if code is not None and worker.name not in reported:
                            reported.add(worker.name)
                            if on_exit is not None:
                                on_exit(worker.name, code)
                    if len(reported) == len(cluster.workers):
                        break  # all gone (e.g. `ftctl sim stop`): nothing left to serve
            except KeyboardInterrupt:
                pass
            return cluster.status
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class StopResult:
    """What `ftctl sim stop` did to each worker."""

    cluster: str
    stopped: tuple[str, ...]
    killed: tuple[str, ...]
    not_running: tuple[str, ...]


def _is_sim_process(pid: int) -> bool:
    args = procfs.cmdline(pid)
    raw = b"\0".join(args or ())
    return b"dynamo_ftctl" in raw and b"serve" in raw


def stop_cluster(
    inventory: Inventory, *, state_dir: Path | None = None, timeout_s: float = 5.0,
) -> StopResult:
    """Stop the workers that `ftctl sim cluster` started, found through their pid files."""
    state = state_dir or default_state_dir(inventory)
    targets: dict[str, Identity] = {}
    not_running: list[str] = []
    for worker in _sim_workers(inventory):
        pid_file = _pid_file(inventory, worker, state)
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            not_running.append(worker.name)
            continue
        # Known by start time from here on: neither a zombie nor a reused pid is the worker.
        identity = Identity.of(pid) if _is_sim_process(pid) else None
        if identity is not None:
            targets[worker.name] = identity
            identity.signal(signal.SIGTERM)
        else:
            not_running.append(worker.name)
            pid_file.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout_s
    killed: list[str] = []
    for name, identity in targets.items():
        if not identity.wait_gone(deadline):
            identity.signal(signal.SIGKILL)
            killed.append(name)
    return StopResult(inventory.cluster, tuple(n for n in targets if n not in killed),
                      tuple(killed), tuple(not_running))
