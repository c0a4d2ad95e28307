"""`--local`: start a scenario's inventory on loopback, and stop all of it whatever happens.

`launch.sim` workers become `ftctl sim` engines (`engine.launcher`),
`launch.command` workers any server the command starts (`drill.command_worker`,
a process group each); a worker without `launch` is already running and is used
where the inventory says. A worker whose injectors include `net` gets a TCP
fault proxy in front of it (in a thread's event loop: the drill's own loop runs
the load). Then the canary daemon (when the inventory names a golden set) and
the migrating proxy start as `ftctl` processes, all on free ports, described by
the inventory the drill writes (`inventory.yaml` in the report folder) and
routes by.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import Unreachable
from dynamo_ftctl.output import write_atomic
from dynamo_ftctl.process import DEVNULL, SPAWNER, Child
from dynamo_ftctl.structs import replace, to_data

if TYPE_CHECKING:
    from pathlib import Path

    from dynamo_ftctl.drill.command_worker import CommandWorker
    from dynamo_ftctl.engine.launcher import LocalCluster
    from dynamo_ftctl.faults.netproxy import NetProxy
    from dynamo_ftctl.inventory import Inventory, Worker

__all__ = ["LocalStack", "local_secrets", "start_local"]

_START_S = 60.0  # the most the daemon or the proxy takes to answer /health 200


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _LoopThread:
    """An event loop in a thread for the TCP fault proxies (the drill's own loop runs load)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="ftctl-netproxy")
        self.thread.start()

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class LocalStack:
    """What `--local` started, so that everything is stopped (`stop`), and restarted."""

    cluster: LocalCluster | None = None
    proxy: Child | None = None
    daemon: Child | None = None
    daemon_url: str | None = None
    netproxies: list[NetProxy] = field(default_factory=list)
    controls: list[Any] = field(default_factory=list)
    loop: _LoopThread | None = None
    launch_inventory: Inventory | None = None  # the sim workers, on their own ports
    commands: dict[str, CommandWorker] = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        """The process id of each worker the drill started (for process faults)."""
        return {w.name: w.pid for w in self.cluster or ()} | {
            n: c.pid for n, c in self.commands.items()}

    def stop(self) -> None:
        """Stop everything started: proxy and daemon (TERM, then KILL), fault proxies, workers."""
        for child in (self.proxy, self.daemon):
            if child is not None:
                child.stop(5.0)
        if self.loop is not None:
            for control in self.controls:
                with contextlib.suppress(Exception):
                    self.loop.call(control.stop())
            for proxy in self.netproxies:
                with contextlib.suppress(Exception):
                    self.loop.call(proxy.stop())
            self.loop.close()
        if self.cluster is not None:
            self.cluster.stop(timeout_s=3)
        for command in self.commands.values():
            command.stop()


def local_secrets(inventory: Inventory, token: str) -> dict[str, str]:
    """One secret for everything a local drill starts: the engines' admin APIs, the fault
    proxies' control APIs, and the canary daemon with the proxy that reports to it."""
    env = {}
    for worker in inventory.workers:
        env[worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"] = token
        env[worker.inject.netproxy_token_env] = token
    env[inventory.canary.token_env] = token
    env[inventory.proxy.health_token_env] = token
    return env


async def _poll_ok(url: str, deadline: float, proc: Child | None) -> None:
    from dynamo_ftctl.http1 import Client, HttpError

    client = Client()
    try:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                msg = f"{url}: the process exited with code {proc.returncode}"
                raise Unreachable(msg)
            with contextlib.suppress(HttpError, TimeoutError):
                status, _ = await client.fetch("GET", url, timeout_s=1.0)
                if status == 200:
                    return
            await asyncio.sleep(0.05)  # polling a condition with a deadline
    finally:
        await client.close()
    msg = f"{url} did not answer 200 in time"
    raise Unreachable(msg)


def _wait_http_ok(url: str, proc: Child | None = None) -> None:
    """Wait until `url` answers 200 (`Unreachable` when `proc` exits or time runs out)."""
    asyncio.run(_poll_ok(url, time.monotonic() + _START_S, proc))


def _spawn_ftctl(args: list[str], log: Path, env: dict[str, str]) -> Child:
    return SPAWNER.spawn([sys.executable, "-m", "dynamo_ftctl", *args],
                         stdout=DEVNULL, stderr=log, env={**os.environ, **env}, group=True)


def _start_workers(inventory: Inventory, out_dir: Path, env: dict[str, str],
                   stack: LocalStack) -> list[tuple[Worker, str, str]]:
    """Start the sim and command workers on free ports: (worker, its URL, how it started)."""
    from dynamo_ftctl.drill.command_worker import start_command_workers
    from dynamo_ftctl.engine.launcher import start_cluster

    launch_workers = []
    route_workers: list[tuple[Worker, str, str]] = []
    commands: list[tuple[Worker, str, int, str]] = []
    where = f"{inventory.source or 'inventory'}"
    for index, worker in enumerate(inventory.workers):
        recipe = worker.launch
        if recipe is not None and recipe.sim is not None:
            sim_url = f"http://127.0.0.1:{_free_port()}"
            launch_workers.append(replace(worker, url=sim_url, process=None))
            route_workers.append((worker, sim_url, "sim"))
        elif recipe is not None and recipe.command is not None:
            port = _free_port()
            commands.append((worker, "127.0.0.1", port, f"{where}: workers[{index}].launch"))
            route_workers.append((worker, f"http://127.0.0.1:{port}", "command"))
        else:
            route_workers.append((worker, worker.url, "running"))
    stack.commands = start_command_workers(commands, log_dir=out_dir,
                                           environ={**os.environ, **env})
    if launch_workers:  # (an inventory of none is refused: every worker a command's)
        launch = replace(inventory, workers=tuple(launch_workers))
        stack.launch_inventory = launch
        stack.cluster = start_cluster(launch, state_dir=out_dir / "cluster", env=env)
    return route_workers


def _route(worker: Worker, direct_url: str, how: str, env: dict[str, str],
           stack: LocalStack) -> dict[str, Any]:
    """The worker's inventory entry as the drill routes it: through its fault proxy when
    it takes `net` faults, probed and signalled directly."""
    from urllib.parse import urlsplit

    from dynamo_ftctl.faults.netproxy import ControlServer, NetProxy

    url = direct_url
    inject = worker.inject
    if "net" in worker.inject.injectors:
        if stack.loop is None:
            stack.loop = _LoopThread()
        parts = urlsplit(direct_url)
        proxy = stack.loop.call(NetProxy(parts.hostname or "127.0.0.1",
                                         parts.port or 80).start())
        control = stack.loop.call(ControlServer(
            proxy, token=env[worker.inject.netproxy_token_env],
            token_env=worker.inject.netproxy_token_env).start())
        stack.netproxies.append(proxy)
        stack.controls.append(control)
        url = f"http://127.0.0.1:{proxy.port}"
        inject = replace(inject, netproxy=control.url)
    data = to_data(worker, exclude_none=True)
    data.update({"url": url, "inject": to_data(inject, exclude_none=True)})
    if how == "running":
        # Probed directly (the admin URL), not through the fault proxy in front of it.
        data.setdefault("admin", {}).setdefault("url", worker.admin_url)
        return data
    data.pop("process", None)
    if how == "command":
        data["process"] = {"pid": stack.commands[worker.name].pid, "group": True}
    admin = (replace(worker.admin, url=direct_url) if worker.admin else None)
    data["admin"] = (to_data(admin, exclude_none=True) if admin
                     else {"url": direct_url})
    return data


def start_local(inventory: Inventory, out_dir: Path, env: dict[str, str],
                stack: LocalStack) -> Inventory:
    """Start the inventory on free loopback ports; return the inventory the drill routes by.

    What starts is recorded in `stack` as it starts, so that a failure half-way
    still stops it all (`stack.stop()`).
    """
    import yaml

    from dynamo_ftctl.inventory import parse_inventory

    routed = [_route(worker, url, how, env, stack)
              for worker, url, how in _start_workers(inventory, out_dir, env, stack)]
    doc = to_data(inventory, exclude_none=True)
    doc["workers"] = routed
    proxy_port = _free_port()
    doc["proxy"]["listen"] = f"127.0.0.1:{proxy_port}"
    if inventory.canary.set is not None:
        # The canary daemon: probes, passive reports from the proxy, weights for routing.
        daemon_port = _free_port()
        stack.daemon_url = f"http://127.0.0.1:{daemon_port}"
        doc["canary"].update({
            "set": str(inventory.resolve(inventory.canary.set).resolve()),
            "listen": f"127.0.0.1:{daemon_port}",
            "transition_log": str((out_dir / "transitions.jsonl").resolve()),
        })
        doc["proxy"]["health_url"] = stack.daemon_url
    path = out_dir / "inventory.yaml"
    text = yaml.safe_dump(doc, sort_keys=False)
    write_atomic(path, text)
    routing = parse_inventory(text, path)
    if stack.daemon_url is not None:
        stack.daemon = _spawn_ftctl(
            ["-i", str(path), "canary", "--watch", "--no-state"], out_dir / "daemon.log", env)
        _wait_http_ok(f"{stack.daemon_url}/health", stack.daemon)
    stack.proxy = _spawn_ftctl(["-i", str(path), "proxy"], out_dir / "proxy.log", env)
    _wait_http_ok(f"http://127.0.0.1:{proxy_port}/health", stack.proxy)
    return routing
