"""Run a chaos drill: hypothesis before → method → rollbacks (always) → hypothesis after.

`run_drill(path, local=...)` is the library behind `ftctl drill`. With
`local`, it first starts the scenario's inventory on loopback — `ftctl sim`
engines (launcher), a TCP fault proxy in front of each worker whose injectors
include `net`, and the migrating proxy as its own process — on free ports, and
stops them all at the end, whatever happens. The method runs the load
generator (`run_load_async`) and, in the same event loop, the timeline of
injections (through `faults.inject`, so the allowlist, audit log and revert
records apply) and probes, while a poller records each worker's state.
Rollbacks run in a `finally`: even on Ctrl-C or a failed step.

The report (`DrillReport`) counts requests sent, failed and migrated, tokens
lost or duplicated, the streams the faults cut mid-generation and how many of them
continued intact (`cut_streams`), TTFT before and after the first fault, and every probe;
`faults/drill_report.py` writes it as JSON, Markdown and a PNG timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import FtctlError, Unreachable, require_extra
from dynamo_ftctl.faults.scenario import (
    METRIC_KINDS,
    Probe,
    Scenario,
    TimelineEntry,
    load_scenario,
)
from dynamo_ftctl.output import check_output_path, make_output_dir, write_atomic

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import LocalCluster
    from dynamo_ftctl.faults.command_worker import CommandWorker
    from dynamo_ftctl.faults.drill_report import DrillReport
    from dynamo_ftctl.faults.netproxy import NetProxy
    from dynamo_ftctl.faults.scenario import LoadProfile
    from dynamo_ftctl.faults.witness import WitnessStream
    from dynamo_ftctl.health.canaryset import CanarySet
    from dynamo_ftctl.inventory import Inventory, Worker
    from dynamo_ftctl.loadgen.config import LoadConfig
    from dynamo_ftctl.loadgen.record import RequestRecord
    from dynamo_ftctl.loadgen.runner import LoadReport

__all__ = ["ProbeOutcome", "TimelineEvent", "cut_streams", "run_drill"]

_POLL_S = 0.2  # worker-state sampling period for the timeline
_WITNESS_WAIT_S = 60.0  # the most a `witness_tokens` fault waits for the streams


@dataclass(frozen=True)
class ProbeOutcome:
    """One probe's verdict at one phase."""

    name: str
    kind: str
    phase: str
    passed: bool
    detail: str
    t_s: float | None = None


@dataclass(frozen=True)
class TimelineEvent:
    """Something the method did at `t_s` seconds into the load."""

    t_s: float
    label: str
    result: str


@dataclass
class _Run:
    """Mutable state of one drill while it runs."""

    scenario: Scenario
    inventory: Inventory
    out_dir: Path
    clock: Clock
    env: dict[str, str]
    target_url: str
    pids: dict[str, int] = field(default_factory=dict)
    events: list[TimelineEvent] = field(default_factory=list)
    probes: list[ProbeOutcome] = field(default_factory=list)
    states: list[tuple[float, str, str]] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)
    canary_set: CanarySet | None = None
    injected_at: list[tuple[str, str, float]] = field(default_factory=list)
    proxy_migrations: int | None = None
    t0: float | None = None
    log: Callable[[str], None] = lambda _: None
    local: bool = False  # a local drill writes Xid lines to its own kmsg.log
    witnesses: list[WitnessStream] | None = None
    live_witnesses: list[WitnessStream] | None = None  # while they stream


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ---------------------------------------------------------------------------
# the local cluster: sim engines, net fault proxies, the migrating proxy


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
class _Local:
    """What `--local` started, so that everything is stopped."""

    cluster: LocalCluster | None = None
    proxy: subprocess.Popen[bytes] | None = None
    daemon: subprocess.Popen[bytes] | None = None
    daemon_url: str | None = None
    netproxies: list[NetProxy] = field(default_factory=list)
    controls: list[Any] = field(default_factory=list)
    loop: _LoopThread | None = None
    launch_inventory: Inventory | None = None
    commands: dict[str, CommandWorker] = field(default_factory=dict)

    def stop(self) -> None:
        for proc in (self.proxy, self.daemon):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
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


def _wait_http_ok(url: str, deadline: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    import httpx

    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            msg = f"{url}: the process exited with code {proc.returncode}"
            raise Unreachable(msg)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)  # polling a condition with a deadline, not waiting for time
    msg = f"{url} did not answer 200 in time"
    raise Unreachable(msg)


def _start_local(inventory: Inventory, out_dir: Path, env: dict[str, str],
                 local: _Local) -> Inventory:
    """Start the inventory on free loopback ports; return the inventory the drill routes by.

    `launch.sim` workers are `ftctl sim` engines, `launch.command` workers any server the
    command starts (in a process group of its own, signalled as one); a worker without a
    `launch` is already running and is used where the inventory says, with its `process`.
    """
    from urllib.parse import urlsplit

    from dynamo_ftctl.engine.launcher import start_cluster
    from dynamo_ftctl.faults.command_worker import start_command_workers
    from dynamo_ftctl.faults.netproxy import ControlServer, NetProxy
    from dynamo_ftctl.inventory import parse_inventory

    launch_workers = []
    route_workers: list[tuple[Worker, str, str]] = []  # (worker, its URL, how it started)
    commands: list[tuple[Worker, str, int, str]] = []
    where = f"{inventory.source or 'inventory'}"
    for index, worker in enumerate(inventory.workers):
        recipe = worker.launch
        if recipe is not None and recipe.sim is not None:
            sim_url = f"http://127.0.0.1:{_free_port()}"
            launch_workers.append(worker.model_copy(update={"url": sim_url, "process": None}))
            route_workers.append((worker, sim_url, "sim"))
        elif recipe is not None and recipe.command is not None:
            port = _free_port()
            commands.append((worker, "127.0.0.1", port, f"{where}: workers[{index}].launch"))
            route_workers.append((worker, f"http://127.0.0.1:{port}", "command"))
        else:
            route_workers.append((worker, worker.url, "running"))
    launch = inventory.model_copy(update={"workers": tuple(launch_workers)})
    local.launch_inventory = launch
    local.commands = start_command_workers(commands, log_dir=out_dir,
                                           environ={**os.environ, **env})
    if launch_workers:
        local.cluster = start_cluster(launch, state_dir=out_dir / "cluster", env=env)
    routed = []
    for worker, direct_url, how in route_workers:
        url = direct_url
        inject = worker.inject
        if "net" in worker.inject.injectors:
            if local.loop is None:
                local.loop = _LoopThread()
            parts = urlsplit(direct_url)
            proxy = local.loop.call(NetProxy(parts.hostname or "127.0.0.1",
                                             parts.port or 80).start())
            control = local.loop.call(ControlServer(
                proxy, token=env[worker.inject.netproxy_token_env],
                token_env=worker.inject.netproxy_token_env).start())
            local.netproxies.append(proxy)
            local.controls.append(control)
            url = f"http://127.0.0.1:{proxy.port}"
            inject = inject.model_copy(update={"netproxy": control.url})
        data = worker.model_dump(by_alias=True, exclude_none=True, mode="json")
        data.update({"url": url, "inject": inject.model_dump(mode="json", exclude_none=True)})
        if how == "running":
            # Probed directly (the admin URL), not through the fault proxy in front of it.
            data.setdefault("admin", {}).setdefault("url", worker.admin_url)
            routed.append(data)
            continue
        data.pop("process", None)
        if how == "command":
            data["process"] = {"pid": local.commands[worker.name].pid, "group": True}
        admin = (worker.admin.model_copy(update={"url": direct_url}) if worker.admin else None)
        data["admin"] = (admin.model_dump(mode="json", exclude_none=True) if admin
                         else {"url": direct_url})
        routed.append(data)
    doc = inventory.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["workers"] = routed
    proxy_port = _free_port()
    doc["proxy"]["listen"] = f"127.0.0.1:{proxy_port}"
    if inventory.canary.set is not None:
        # The canary daemon: probes, passive reports from the proxy, weights for routing.
        daemon_port = _free_port()
        local.daemon_url = f"http://127.0.0.1:{daemon_port}"
        doc["canary"].update({
            "set": str(inventory.resolve(inventory.canary.set).resolve()),
            "listen": f"127.0.0.1:{daemon_port}",
            "transition_log": str((out_dir / "transitions.jsonl").resolve()),
        })
        doc["proxy"]["health_url"] = local.daemon_url
    import yaml

    path = out_dir / "inventory.yaml"
    text = yaml.safe_dump(doc, sort_keys=False)
    write_atomic(path, text)
    routing = parse_inventory(text, path)
    if local.daemon_url is not None:
        local.daemon = _spawn_ftctl(
            ["-i", str(path), "canary", "--watch", "--no-state"], out_dir / "daemon.log", env)
        _wait_http_ok(f"{local.daemon_url}/health", time.monotonic() + 60, local.daemon)
    local.proxy = _spawn_ftctl(["-i", str(path), "proxy"], out_dir / "proxy.log", env)
    _wait_http_ok(f"http://127.0.0.1:{proxy_port}/health", time.monotonic() + 60, local.proxy)
    return routing


def _spawn_ftctl(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", *args], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=handle, env={**os.environ, **env},
            start_new_session=True,
        )


# ---------------------------------------------------------------------------
# probes


def _probe_workers(run: _Run, probe: Probe) -> list[str]:
    return list(probe.workers) or [w.name for w in run.inventory.workers]


def _workers_healthy(run: _Run, probe: Probe) -> tuple[bool, str]:
    import httpx

    deadline = time.monotonic() + probe.within_s
    waiting = _probe_workers(run, probe)
    while True:
        down = []
        for name in waiting:
            url = run.inventory.worker(name).admin_url
            try:
                ok = httpx.get(f"{url}/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(name)
        if not down:
            return True, f"all of {', '.join(waiting)} answer /health 200"
        if time.monotonic() >= deadline:
            return False, f"not healthy within {probe.within_s:g} s: {', '.join(down)}"
        waiting = down
        time.sleep(0.1)  # re-check a condition until its deadline


def _canary(run: _Run, probe: Probe) -> tuple[bool, str]:
    from dynamo_ftctl.health.probe import ProbeTarget, probe_worker
    from dynamo_ftctl.health.record import record_canary_set

    names = _probe_workers(run, probe)
    if run.canary_set is None:
        if run.inventory.canary.set is not None:
            from dynamo_ftctl.health.canaryset import load_canary_set

            run.canary_set = load_canary_set(run.inventory.resolve(run.inventory.canary.set))
        else:
            # No golden set named: record one from the first worker of the fresh cluster.
            first = run.inventory.workers[0]
            run.canary_set = record_canary_set(
                ProbeTarget(first.name, first.admin_url, first.model), model=first.model)
    deadline = time.monotonic() + probe.within_s
    while True:
        verdicts = {}
        for name in names:
            worker = run.inventory.worker(name)
            result = probe_worker(ProbeTarget(name, worker.admin_url, worker.model),
                                  run.canary_set, run.inventory.canary)
            verdicts[name] = (result.verdict, result.reason)
        want = probe.expect
        bad = {n: v for n, v in verdicts.items() if (v[0] == "healthy") != (want == "healthy")}
        if not bad:
            return True, "; ".join(f"{n}: {v[0]}" for n, v in verdicts.items())
        if time.monotonic() >= deadline:
            return False, "; ".join(f"{n}: {v[0]} ({v[1]})" for n, v in bad.items())
        time.sleep(0.2)  # re-probe until the deadline


def _shed(run: _Run, probe: Probe) -> tuple[bool, str]:
    """One request at a time with the probe's priority until the proxy sheds one properly."""
    import json

    import httpx

    from dynamo_ftctl.migrate.admission import BUSY_BODY
    from dynamo_ftctl.openai import completion_request

    want = {**BUSY_BODY, "code": 503}
    body = completion_request(run.inventory.workers[0].model, "shed?", max_tokens=1)
    headers = {"x-ftctl-priority": str(probe.priority)}
    deadline = time.monotonic() + probe.within_s
    sent = 0
    last = "no answer"
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            sent += 1
            try:
                response = client.post(f"{run.target_url}/v1/completions", json=body,
                                       headers=headers)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code == 503:
                retry_after = response.headers.get("retry-after")
                try:
                    answer = json.loads(response.content)
                except ValueError:
                    answer = response.text[:200]
                if retry_after is not None and answer == want:
                    return True, (f"{probe.priority}: 503 with Retry-After: {retry_after} and "
                                  f"the busy body (request {sent})")
                last = f"503 with Retry-After {retry_after!r} and body {answer!r}"
            else:
                last = f"HTTP {response.status_code}"
            time.sleep(0.02)  # next try of a condition bounded by the deadline
    return False, f"{probe.priority}: not shed within {probe.within_s:g} s ({sent} sent; {last})"


def _state_probe(run: _Run, probe: Probe, phase: str, t_s: float | None = None) -> ProbeOutcome:
    checks = {"workers_healthy": _workers_healthy, "canary": _canary, "shed": _shed}
    check = checks[probe.kind]
    try:
        passed, detail = check(run, probe)
    except FtctlError as exc:
        passed, detail = False, str(exc)
    outcome = ProbeOutcome(probe.name, probe.kind, phase, passed, detail, t_s)
    run.log(f"{phase}: {probe.name}: {'ok' if passed else 'FAILED'} ({detail})")
    return outcome


def load_counts(report: LoadReport, max_tokens: int) -> dict[str, Any]:
    """Requests sent/failed/migrated/rejected and tokens lost/duplicated of a load run.

    Drill loads ask for exactly `max_tokens` tokens (ignore_eos), so a completed
    answer with fewer lost some, and one with more repeated some.
    """
    return _counts([(r, max_tokens) for r in report.records if not r.warmup])


def _counts(measured: list[tuple[RequestRecord, int]]) -> dict[str, Any]:
    ok = [(r, n) for r, n in measured if r.ok]
    lost = sum(max(0, n - r.output_tokens) for r, n in ok)
    duplicated = sum(max(0, r.output_tokens - n) for r, n in ok)
    shed = [r for r, _ in measured if r.status in (503, 529)]
    return {"sent": len(measured), "completed": len(ok), "failed": len(measured) - len(ok),
            "migrated": sum(1 for r, _ in measured if r.migrated), "rejected": len(shed),
            "shed_with_retry_after": sum(1 for r in shed if r.retry_after_s is not None),
            "tokens_lost": lost, "tokens_duplicated": duplicated,
            "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0.0,
            "admitted_error_rate": (
                (len(measured) - len(ok) - len(shed)) / (len(measured) - len(shed))
                if len(measured) > len(shed) else 0.0)}


def loads_counts(runs: list[tuple[LoadProfile, LoadReport]]) -> dict[str, Any]:
    """`load_counts` over every profile, and per priority (`by_priority`) when they differ."""
    measured = [(r, profile.max_tokens) for profile, report in runs
                for r in report.records if not r.warmup]
    counts = _counts(measured)
    if len(runs) > 1:
        counts["by_priority"] = {
            tier: _counts([(r, profile.max_tokens) for profile, report in runs
                           if (profile.priority or "standard") == tier
                           for r in report.records if not r.warmup])
            for tier in dict.fromkeys(profile.priority or "standard" for profile, _ in runs)
        }
    return counts


def _add_witness_counts(counts: dict[str, Any], run: _Run) -> None:
    """Witness streams count as requests too; their own figures go under `witness`."""
    from dynamo_ftctl.faults.witness import witness_counts

    witness = run.scenario.method.witness
    assert witness is not None
    assert run.witnesses is not None
    seen = witness_counts(run.witnesses, witness.max_tokens)
    counts["witness"] = seen
    for key in ("failed", "tokens_lost", "tokens_duplicated"):
        counts[key] += seen[key]
    counts["sent"] += seen["streams"]
    counts["completed"] += seen["streams"] - seen["failed"]
    counts["streams_cut"] = seen["cut"]
    counts["ids_mismatched"] = seen["ids_mismatched"]


def cut_streams(runs: list[tuple[LoadProfile, LoadReport]],
                witness: dict[str, Any] | None) -> dict[str, int]:
    """Streams the proxy moved mid-generation, and how many of them continued intact.

    A witness stream is intact when its token ids equal the fault-free run's; a load
    stream (no ids) when it completed with exactly its `max_tokens` tokens.
    """
    moved = [(r, profile.max_tokens) for profile, report in runs
             for r in report.records if not r.warmup and r.migrated]
    complete = sum(1 for r, n in moved if r.ok and r.output_tokens == n)
    w_cut = (witness["cut"] + witness["cut_failed"]) if witness else 0
    w_intact = witness["cut_intact"] if witness else 0
    return {"streams": w_cut + len(moved), "continued_intact": w_intact + complete,
            "witness": w_cut, "witness_token_identical": w_intact,
            "load": len(moved), "load_complete": complete}


def _metric_probe(probe: Probe, counts: dict[str, Any], ttft_p99: float | None) -> ProbeOutcome:
    assert probe.max is not None
    if probe.priority is not None:
        tiers = counts.get("by_priority", {})
        if probe.priority not in tiers:
            return ProbeOutcome(probe.name, probe.kind, "after", False,
                                f"no {probe.priority} load in the method")
        counts = tiers[probe.priority]
    value: float | None
    if probe.kind == "ttft_p99_ms":
        value = ttft_p99
    elif probe.kind == "streams_cut_min":
        value = float(counts.get("streams_cut", 0))
        return ProbeOutcome(probe.name, probe.kind, "after", value >= probe.max,
                            f"{value:g} witness streams cut and continued (need ≥ "
                            f"{probe.max:g})")
    elif probe.kind == "rejected_min":
        value = float(counts["rejected"])
        passed = value >= probe.max
        return ProbeOutcome(probe.name, probe.kind, "after", passed,
                            f"{value:g} rejected (need ≥ {probe.max:g})")
    else:
        value = float(counts[probe.kind])
    if value is None:
        return ProbeOutcome(probe.name, probe.kind, "after", False, "no measurement")
    return ProbeOutcome(probe.name, probe.kind, "after", value <= probe.max,
                        f"{value:.4g} (tolerance ≤ {probe.max:g})")


# ---------------------------------------------------------------------------
# the method


def _inject(run: _Run, entry: TimelineEntry) -> str:
    from dynamo_ftctl.faults.inject import InjectOptions, plan_injection, run_injection
    from dynamo_ftctl.faults.injectors import Injectors

    assert entry.fault is not None
    assert entry.worker is not None
    options = InjectOptions(
        pid=run.pids.get(entry.worker), delay_ms=entry.delay_ms, jitter_ms=entry.jitter_ms,
        after_tokens=entry.after_tokens, rate_kbps=entry.rate_kbps, duration_s=entry.duration_s,
        kmsg_path=run.out_dir / "kmsg.log" if run.local else None,
    )
    plan = plan_injection(run.inventory, entry.worker, entry.fault, options)
    result = run_injection(plan, injectors=Injectors(environ={**os.environ, **run.env}),
                           audit_log=run.out_dir / "audit.jsonl",
                           state_dir=run.out_dir / "state", clock=run.clock)
    return "; ".join(result.outcomes) + ("; reverted" if result.reverted else "")


async def _timeline(run: _Run, started: asyncio.Event,
                    markers: list[tuple[float, str]]) -> None:
    await started.wait()
    assert run.t0 is not None
    entries = sorted(run.scenario.method.timeline, key=lambda e: e.at_s)
    timed: list[asyncio.Future[None]] = []  # injections that revert themselves later
    for entry in entries:
        await run.clock.asleep(run.t0 + entry.at_s - run.clock.now())
        t = run.clock.now() - run.t0
        if entry.probe is not None:
            outcome = await asyncio.to_thread(_state_probe, run, entry.probe, "during", t)
            run.probes.append(outcome)
            label = f"probe {entry.probe.name}"
            run.events.append(TimelineEvent(round(t, 3), label,
                                            "ok" if outcome.passed else "failed"))
            continue
        label = f"{entry.fault} {entry.worker}"
        if entry.witness_tokens is not None:
            await _await_witness_tokens(run, entry.witness_tokens, label)
            t = run.clock.now() - run.t0
        markers.append((t, label))
        run.injected_at.append((label, entry.worker or "", run.clock.wall()))
        # Thread: an injection with a duration waits, and the load must go on meanwhile.
        task = asyncio.to_thread(_inject, run, entry)
        if entry.duration_s is not None:
            timed.append(asyncio.ensure_future(_record(run, t, label, task)))
        else:
            await _record(run, t, label, task)
        run.log(f"t={t:.2f}s {label}")
    await asyncio.gather(*timed)


async def _record(run: _Run, t: float, label: str, task: Any) -> None:
    try:
        result = await task
    except FtctlError as exc:
        result = f"failed: {exc}"
    run.events.append(TimelineEvent(round(t, 3), label, result))


async def _poll_states(run: _Run, started: asyncio.Event, stop: asyncio.Event) -> None:
    import aiohttp

    await started.wait()
    assert run.t0 is not None
    timeout = aiohttp.ClientTimeout(total=_POLL_S * 2)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(name: str, url: str) -> tuple[str, str]:
            try:
                async with session.get(f"{url}/health") as response:
                    return name, "up" if response.status == 200 else f"http {response.status}"
            except (aiohttp.ClientError, TimeoutError):
                return name, "down"

        while not stop.is_set():
            t = run.clock.now() - run.t0
            results = await asyncio.gather(*(one(w.name, w.admin_url)
                                             for w in run.inventory.workers))
            run.states.extend((round(t, 3), name, state) for name, state in results)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _POLL_S)


def _proxy_migrations(url: str) -> float | None:
    """The proxy's `ftctl_migrations_total`, summed over labels (None: no proxy answer).

    Streams learn of their migration only in a trailing SSE comment, which the load
    generator does not read, so the drill counts migrations where they happen.
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "ftctl_migrations":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _load_config(run: _Run, load: LoadProfile) -> LoadConfig:
    from dynamo_ftctl.loadgen.config import Length, LoadConfig, Schedule, Workload

    targets = ((run.target_url,) if load.via == "proxy"
               else tuple(w.url for w in run.inventory.workers))
    return LoadConfig(
        targets=targets,
        schedule=Schedule(rate=load.rate, arrival="poisson", seed=load.seed,
                          concurrency=load.concurrency),
        workload=Workload(model=run.inventory.workers[0].model,
                          prompt_tokens=Length.fixed(load.prompt_tokens),
                          max_tokens=Length.fixed(load.max_tokens), stream=load.stream,
                          ignore_eos=True, priority=load.priority),
        duration_s=load.duration_s, timeout_s=load.timeout_s,
    )


async def _witness(run: _Run, started: asyncio.Event) -> list[WitnessStream]:
    """The witness streams through the proxy, from `witness.at_s` into the load."""
    from dynamo_ftctl.faults.witness import new_witnesses, run_witnesses

    witness = run.scenario.method.witness
    assert witness is not None
    streams = new_witnesses(witness, run.inventory.workers[0].model)
    await started.wait()
    assert run.t0 is not None
    await run.clock.asleep(run.t0 + witness.at_s - run.clock.now())
    run.log(f"t={run.clock.now() - run.t0:.2f}s {witness.streams} witness streams")
    run.live_witnesses = streams
    await run_witnesses(witness, run.target_url, streams)
    return streams


async def _await_witness_tokens(run: _Run, tokens: int, label: str) -> None:
    """Wait until every witness stream has `tokens` token ids (or ended), at most
    `_WITNESS_WAIT_S`: a fault timed by the clock alone can land before a slow engine
    has started the streams it is meant to cut (CI: none of six was cut once)."""
    deadline = run.clock.now() + _WITNESS_WAIT_S
    while run.clock.now() < deadline:
        streams = run.live_witnesses
        if streams and all(len(s.ids) >= tokens or s.finished or s.error for s in streams):
            return
        await run.clock.asleep(0.01)
    run.log(f"{label}: the witness streams did not all reach {tokens} tokens within "
            f"{_WITNESS_WAIT_S:g} s; injecting anyway")


def _healthy_worker(run: _Run) -> str | None:
    import httpx

    for worker in run.inventory.workers:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{worker.admin_url}/health", timeout=2.0).status_code == 200:
                return worker.admin_url
    return None


async def _compare_witnesses(run: _Run, streams: list[WitnessStream]) -> None:
    """The fault-free run of each witness, straight from a healthy worker (admin URL)."""
    from dynamo_ftctl.faults.witness import compare_witnesses

    witness = run.scenario.method.witness
    assert witness is not None
    url = await asyncio.to_thread(_healthy_worker, run)
    if url is None:
        run.log("witness: no healthy worker for the fault-free run")
        return
    await compare_witnesses(witness, streams, url)


async def _method(run: _Run) -> list[tuple[LoadProfile, LoadReport]]:
    """The timeline over every load profile at once; each profile's report."""
    from dynamo_ftctl.loadgen.runner import LoadEvent, run_load_async

    method = run.scenario.method
    started = asyncio.Event()
    stop = asyncio.Event()
    markers: list[tuple[float, str]] = []
    poller = asyncio.ensure_future(_poll_states(run, started, stop))
    try:
        profiles = method.profiles
        if not profiles:
            run.t0 = run.clock.now()
            started.set()
            await _timeline(run, started, markers)
            await run.clock.asleep(method.settle_s)
            return []

        def on_event(event: LoadEvent) -> None:
            if event.kind == "started" and not started.is_set():
                run.t0 = event.t0
                started.set()

        via_proxy = any(p.via == "proxy" for p in profiles)
        timeline = asyncio.ensure_future(_timeline(run, started, markers))
        witnesses = (asyncio.ensure_future(_witness(run, started))
                     if method.witness is not None else None)
        migrations_before = (await asyncio.to_thread(_proxy_migrations, run.target_url)
                             if via_proxy else None)
        try:
            # Only the first profile carries the fault markers (one plot timeline).
            reports = await asyncio.gather(*(
                run_load_async(_load_config(run, p), on_event=on_event,
                               markers=markers if i == 0 else [])
                for i, p in enumerate(profiles)))
            if witnesses is not None:
                run.witnesses = await witnesses
                await _compare_witnesses(run, run.witnesses)
            if migrations_before is not None:
                after = await asyncio.to_thread(_proxy_migrations, run.target_url)
                if after is not None:
                    run.proxy_migrations = int(after - migrations_before)
            await asyncio.wait_for(timeline, timeout=max(5.0, run.scenario.timeout_s))
        finally:
            timeline.cancel()
            if witnesses is not None:
                witnesses.cancel()
        await run.clock.asleep(method.settle_s)
        return list(zip(profiles, reports, strict=True))
    finally:
        stop.set()
        await poller


# ---------------------------------------------------------------------------
# rollbacks


def _rollback(run: _Run, local: _Local) -> None:
    from dynamo_ftctl.faults.inject import revert_pending
    from dynamo_ftctl.faults.injectors import Injectors

    for rollback in run.scenario.rollbacks:
        try:
            if rollback.action == "revert_faults":
                result = revert_pending(
                    all_=True, injectors=Injectors(environ={**os.environ, **run.env}),
                    audit_log=run.out_dir / "audit.jsonl", state_dir=run.out_dir / "state")
                done = ", ".join(f"{r['fault']} {r['worker']}" for r in result.reverted)
                failed = ", ".join(f"{r['fault']} {r['worker']}: {r['error']}"
                                   for r in result.failed)
                text = f"reverted: {done or 'nothing pending'}"
                run.rollbacks.append(text + (f"; FAILED: {failed}" if failed else ""))
            elif local.cluster is not None or local.commands:
                run.rollbacks.append(_restart_dead(run, local))
        except (FtctlError, OSError) as exc:
            run.rollbacks.append(f"{rollback.action} failed: {exc}")
        run.log(f"rollback: {run.rollbacks[-1]}")


def _restart_dead(run: _Run, local: _Local) -> str:
    from dynamo_ftctl.engine.launcher import start_worker

    restarted = []
    for command in local.commands.values():
        if command.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(command.pid, signal.SIGCONT)  # a SIGSTOPped group resumes
            continue
        command.restart()
        run.pids[command.name] = command.pid
        restarted.append(command.name)
    if local.cluster is None or local.launch_inventory is None:
        return f"restarted: {', '.join(restarted) or 'none needed'}"
    for worker in local.launch_inventory.workers:
        process = local.cluster.workers.get(worker.name)
        if process is None:
            continue
        if process.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)  # a SIGSTOPped engine resumes
            continue
        process.stop(timeout_s=0)
        sim = worker.launch.sim if worker.launch else None
        if sim is None:
            continue
        port = int(worker.url.rsplit(":", 1)[1])
        token_env = worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"
        new = start_worker(
            worker.name, port=port, seed=sim.seed, model_config=sim.model_config_name,
            args=(*sim.args, "--served-model-name", worker.model),
            pid_file=local.cluster.state_dir / f"{worker.name}.pid",
            log_path=local.cluster.state_dir / f"{worker.name}.restarted.log",
            admin_token_env=token_env, env=run.env, timeout_s=60,
        )
        local.cluster.workers[worker.name] = new
        run.pids[worker.name] = new.pid
        restarted.append(worker.name)
    return f"restarted: {', '.join(restarted) or 'none needed'}"


# ---------------------------------------------------------------------------
# the drill


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM bounds the whole drill (main thread only; elsewhere unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(*_: object) -> None:
        msg = f"the drill ran past its timeout_s of {seconds:g} s"
        raise Unreachable(msg)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _ttft_split(records: list[RequestRecord] | None,
                first_fault: float | None) -> dict[str, Any]:
    from dynamo_ftctl.loadgen.stats import percentile

    if records is None:
        return {}
    measured = [r for r in records if not r.warmup and r.ttft_s is not None]
    all_ms = [r.ttft_s * 1000 for r in measured if r.ttft_s is not None]
    before = [r.ttft_s * 1000 for r in measured
              if r.ttft_s is not None and (first_fault is None or r.planned < first_fault)]
    after = [r.ttft_s * 1000 for r in measured
             if r.ttft_s is not None and first_fault is not None and r.planned >= first_fault]

    def p(values: list[float], q: float) -> float | None:
        return round(percentile(sorted(values), q), 2) if values else None

    return {"ttft_p50_ms": p(all_ms, 50), "ttft_p99_ms": p(all_ms, 99),
            "ttft_p99_before_fault_ms": p(before, 99), "ttft_p99_after_fault_ms": p(after, 99)}


def _drained_probe(run: _Run, probe: Probe, detections: dict[str, float | None]) -> ProbeOutcome:
    assert probe.max is not None
    wanted = [(label, worker) for label, worker, _ in run.injected_at
              if not probe.workers or worker in probe.workers]
    if not wanted:
        return ProbeOutcome(probe.name, probe.kind, "after", False, "no fault was injected")
    slow = [f"{label}: {'not drained' if detections.get(label) is None else detections[label]}"
            for label, _ in wanted
            if detections.get(label) is None or (detections[label] or 0) > probe.max]
    shown = ", ".join(f"{label} {detections.get(label)} s" for label, _ in wanted)
    return ProbeOutcome(probe.name, probe.kind, "after", not slow,
                        (f"drained: {shown}" if not slow else "; ".join(slow))
                        + f" (tolerance ≤ {probe.max:g} s)")


def _detections(run: _Run, log: Path) -> dict[str, float | None]:
    """Per injection: seconds until the canary daemon took the worker out (weight 0)."""
    import json

    if not log.exists():
        return {}
    out: dict[str, float | None] = {}
    transitions = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            transitions.append(json.loads(line))
    for label, worker, wall in run.injected_at:
        drained = [t["ts"] for t in transitions
                   if t.get("worker") == worker and t.get("weight") == 0 and t["ts"] >= wall]
        out[label] = round(min(drained) - wall, 3) if drained else None
    return out


def run_drill(
    path: Path | str, *, local: bool = False, out_dir: Path | None = None,
    clock: Clock = SYSTEM_CLOCK, log: Callable[[str], None] | None = None,
    plot: bool = True,
) -> DrillReport:
    """Run one scenario end to end and write its report files under `out_dir`."""
    from dynamo_ftctl.faults.drill_report import REPORT_FILES, DrillReport, write_report

    path = Path(path)
    scenario, inventory = load_scenario(path)
    if local and any(w.launch is not None and w.launch.sim is not None
                     for w in inventory.workers):
        # Before the report folder exists: a missing torch is an install to do (exit 2),
        # not a failed drill (exit 1).
        require_extra("torch")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock.wall()))
    out = out_dir or Path("reports") / "drills" / f"{path.stem}-{stamp}"
    make_output_dir(out)
    for name in REPORT_FILES:  # refused before the drill runs, not after
        check_output_path(out / name)
    token = secrets.token_hex(16)
    env = {}
    if local:
        # One secret for everything the drill starts: engines' admin APIs, the fault
        # proxies' control APIs, and the canary daemon with the proxy that reports to it.
        for worker in inventory.workers:
            env[worker.admin.token_env if worker.admin else "FTCTL_ADMIN_TOKEN"] = token
            env[worker.inject.netproxy_token_env] = token
        env[inventory.canary.token_env] = token
        env[inventory.proxy.health_token_env] = token
    run = _Run(scenario=scenario, inventory=inventory, out_dir=out, clock=clock, env=env,
               target_url=f"http://{inventory.proxy.listen}", log=log or (lambda _: None),
               local=local)
    started_at = clock.wall()
    local_run = _Local()
    runs: list[tuple[LoadProfile, LoadReport]] | None = None
    error: str | None = None
    interrupted = False
    before_ok = False
    try:
        with _deadline(scenario.timeout_s):
            try:
                if local:
                    run.inventory = _start_local(inventory, out, env, local_run)
                    run.target_url = f"http://{run.inventory.proxy.listen}"
                    run.pids = {w.name: w.pid for w in local_run.cluster or ()}
                    run.pids |= {n: c.pid for n, c in local_run.commands.items()}
                state_probes = [p for p in scenario.hypothesis.probes
                                if p.kind not in METRIC_KINDS]
                before = [_state_probe(run, p, "before") for p in state_probes]
                run.probes.extend(before)
                before_ok = all(p.passed for p in before)
                if before_ok:
                    runs = asyncio.run(_method(run))
            except KeyboardInterrupt:
                interrupted = True
                error = "interrupted"
            except FtctlError as exc:
                error = str(exc)
            finally:
                _rollback(run, local_run)
            if before_ok and not interrupted:
                run.probes.extend(_state_probe(run, p, "after") for p in state_probes)
    except FtctlError as exc:
        error = error or str(exc)
    finally:
        local_run.stop()
    detections = _detections(run, out / "transitions.jsonl")
    first_fault = min((e.at_s for e in scenario.method.timeline if e.fault), default=None)
    records = sorted((r for _, rep in runs or () for r in rep.records), key=lambda r: r.planned)
    latency = _ttft_split(records if runs else None, first_fault)
    counts: dict[str, Any] = {}
    if before_ok:
        run.probes.extend(_drained_probe(run, p, detections)
                          for p in scenario.hypothesis.probes if p.kind == "drained_s")
    if runs:
        counts = loads_counts(runs)
        if run.witnesses is not None:
            _add_witness_counts(counts, run)
        counts["cut"] = cut_streams(runs, counts.get("witness"))
        if run.proxy_migrations is not None:
            counts["migrated"] = max(counts["migrated"], run.proxy_migrations)
        for probe in scenario.hypothesis.probes:
            if probe.kind in METRIC_KINDS and probe.kind != "drained_s":
                run.probes.append(_metric_probe(probe, counts, latency.get("ttft_p99_ms")))
    passed = (before_ok and error is None
              and (bool(runs) or not scenario.method.profiles)
              and all(p.passed for p in run.probes))
    drill = DrillReport(
        scenario=str(path), title=scenario.title, local=local, passed=bool(passed),
        started_at=started_at, elapsed_s=round(clock.wall() - started_at, 3),
        error=error, counts=counts, latency=latency, probes=tuple(run.probes),
        events=tuple(sorted(run.events, key=lambda e: e.t_s)), rollbacks=tuple(run.rollbacks),
        states=tuple(run.states), out_dir=out, detections=detections,
        records=tuple((r.planned, r.done, r.ttft_s, r.ok, r.status) for r in records),
    )
    drill = write_report(drill, plot=plot)
    if interrupted:
        raise KeyboardInterrupt
    return drill
