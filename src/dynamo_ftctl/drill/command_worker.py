"""Any OpenAI-compatible server as a drill worker, started from an inventory's `launch.command`.

`start_command_workers` expands each command's `{host}`, `{port}`, `{model}` and `${VAR}`,
starts it in a session (so a process group) of its own, waits for its health path with a
deadline and sends one warm-up request; `CommandWorker.stop` SIGTERMs the group and
SIGKILLs it after a deadline (`process.Child.stop`). An engine of several processes
(vLLM: API server and engine core) is signalled, stopped and restarted as one. This
module knows no engine by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.process import SPAWNER, STDOUT, Child, OwnsChild, Spawner

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Worker
    from dynamo_ftctl.inventory.launch import Launch

__all__ = ["CommandWorker", "expand_command", "start_command_workers"]

_ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_STOP_S = 20.0  # a SIGTERMed vLLM stops its engine core first: a few seconds on CPU
_POLL_S = 0.25  # health poll interval (a condition with a deadline, not a wait)


@dataclass
class CommandWorker(OwnsChild):
    """One server started from `launch.command`, leading its own process group."""

    name: str
    url: str
    model: str
    launch: Launch
    argv: list[str]
    env: dict[str, str]
    log: Path
    child: Child
    spawner: Spawner = field(default=SPAWNER, repr=False)

    def stop(self, timeout_s: float = _STOP_S) -> None:
        """SIGCONT and SIGTERM the group; SIGKILL it after `timeout_s` (and, in any case,
        the children the leader left behind); reap the leader."""
        self.child.stop(timeout_s)

    def restart(self) -> None:
        """Start the same command again on the same port and wait until it serves."""
        self.stop()
        self.child = _spawn(self.spawner, self.argv, self.env, self.log, append=True)
        _await_ready(self, time.monotonic() + self.launch.start_timeout_s)

    def log_tail(self) -> str:
        """The last line of the server's output, for one-line errors."""
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:200] if lines else ""


def _expand(value: str, environ: Mapping[str, str], where: str) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if not environ.get(name):
            msg = f"{where}: ${{{name}}} is not set (export it before the drill)"
            raise InvalidInput(msg)
        return environ[name]

    return _ENV_VAR.sub(one, value)


def expand_command(worker: Worker, *, host: str, port: int, environ: Mapping[str, str],
                   where: str) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of `worker`'s `launch.command`, every placeholder
    filled; `InvalidInput` names the key (`where`: `file: workers[i].launch`) of an unset
    `${VAR}`."""
    launch = worker.launch
    assert launch is not None
    assert launch.command is not None
    values = {"host": host, "port": str(port), "model": worker.model}
    argv = []
    for index, part in enumerate(launch.command):
        expanded = _expand(part, environ, f"{where}.command[{index}]")
        argv.append(re.sub(r"(?<!\$)\{(host|port|model)\}", lambda m: values[m.group(1)],
                           expanded))
    env = {key: _expand(value, environ, f"{where}.env.{key}")
           for key, value in launch.env.items()}
    return argv, env


def _spawn(spawner: Spawner, argv: list[str], env: dict[str, str], log: Path, *,
           append: bool = False) -> Child:
    try:
        return spawner.spawn(argv, stdout=log, stderr=STDOUT, append=append,
                             env={**os.environ, **env}, group=True)
    except OSError as exc:
        msg = f"cannot start {argv[0]}: {exc.strerror or exc}"
        raise InvalidInput(msg) from None


def _await_ready(worker: CommandWorker, deadline: float) -> None:
    """/health (the launch's path) 200 by `deadline`, then one warm-up completion."""
    from dynamo_ftctl.http1 import fetch_blocking

    launch = worker.launch
    while True:
        code = worker.child.poll()
        if code is not None:
            msg = (f"worker {worker.name}: {worker.argv[0]} exited with code {code} "
                   f"before serving ({worker.log}: {worker.log_tail()})")
            raise Unreachable(msg)
        with contextlib.suppress(OSError):  # http1's HttpError or TimeoutError: not yet
            if fetch_blocking("GET", worker.url + launch.health_path, timeout_s=5.0)[0] == 200:
                break
        if time.monotonic() >= deadline:
            msg = (f"worker {worker.name}: {worker.url}{launch.health_path} not 200 within "
                   f"{launch.start_timeout_s:g} s ({worker.log}: {worker.log_tail()})")
            raise Unreachable(msg)
        time.sleep(_POLL_S)
    if launch.warmup:
        body = json.dumps({"model": worker.model, "prompt": "warm up", "max_tokens": 4})
        try:
            status, answer = fetch_blocking(
                "POST", worker.url + "/v1/completions", body.encode(),
                {"Content-Type": "application/json"},
                timeout_s=max(5.0, deadline - time.monotonic()))
        except OSError as exc:
            msg = f"worker {worker.name}: warm-up request failed: {type(exc).__name__}"
            raise Unreachable(msg) from None
        if status != 200:
            msg = (f"worker {worker.name}: warm-up request answered HTTP "
                   f"{status}: {answer[:200].decode('utf-8', 'replace')}")
            raise Unreachable(msg)


def start_command_workers(
    workers: Sequence[tuple[Worker, str, int, str]], *, log_dir: Path,
    environ: Mapping[str, str], spawner: Spawner = SPAWNER,
) -> dict[str, CommandWorker]:
    """Start every (worker, host, port, where) at once; wait until each serves.

    All or nothing: when one fails to start, the others are stopped before the error.
    """
    started: dict[str, CommandWorker] = {}
    try:
        prepared = []
        for worker, host, port, where in workers:
            argv, env = expand_command(worker, host=host, port=port, environ=environ,
                                       where=where)
            prepared.append((worker, host, port, argv, env))
        for worker, host, port, argv, env in prepared:
            assert worker.launch is not None
            log = log_dir / f"{worker.name}.log"
            started[worker.name] = CommandWorker(
                name=worker.name, url=f"http://{host}:{port}", model=worker.model,
                launch=worker.launch, argv=argv, env=env, log=log,
                child=_spawn(spawner, argv, env, log), spawner=spawner)
        for command_worker in started.values():
            _await_ready(command_worker,
                         time.monotonic() + command_worker.launch.start_timeout_s)
    except BaseException:
        for command_worker in started.values():
            command_worker.stop(timeout_s=5)
        raise
    return started
