"""The health daemon (`ftctl canary --watch`): probes, passive signals, state, HTTP API.

`HealthDaemon` is the engine, usable from Python and driven in tests by a fake
clock and a fake transport:

- every `interval_s` it probes each worker whose breaker allows it, at most
  `concurrency` probes in flight (one shared http1 client: 10,000 workers within
  one interval from one process, see benchmarks/canary.py);
- a failure that leaves a worker SUSPICIOUS triggers an immediate confirmation
  probe, so a dead worker reaches UNHEALTHY in `failure_threshold` fast probes
  instead of `failure_threshold` intervals;
- passive signals (`report`: the proxy's failed request or broken stream, the
  GPU watcher's Xid for a worker's GPUs) count as failures at once and also
  trigger an early probe, at most one per worker per `REPORT_PROBE_GAP_S`
  (reports cannot make the daemon hammer a worker); a report never restores a
  worker: `"ok": true` changes nothing, only a passing probe does;
- each transition updates the metrics, is handed to `on_transition` (the JSON
  line log) and runs the inventory's actions.

Its HTTP API (`create_app`, `serve_api`, `split_listen`) lives in `health.api`
and is re-exported here. `run_daemon` runs the daemon and its API until
SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.auth import token_from_env
from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.health.acting import ActingGate
from dynamo_ftctl.health.actions import ActionOutcome, actions_for, run_action
from dynamo_ftctl.health.api import create_app, serve_api, split_listen
from dynamo_ftctl.health.baseline import Baselines, BaselineStore
from dynamo_ftctl.health.fanout import ClientTransport
from dynamo_ftctl.health.probe import ProbeResult, ProbeTarget, aprobe_worker
from dynamo_ftctl.health.state import (
    BreakerState,
    HealthState,
    MachineConfig,
    SignalSource,
    Transition,
    WorkerHealth,
)
from dynamo_ftctl.http1.transport import AsyncTransport
from dynamo_ftctl.redact import install_log_redaction, redact_url

if TYPE_CHECKING:
    from dynamo_ftctl.health.canaryset import CanarySet
    from dynamo_ftctl.inventory import Inventory
    from dynamo_ftctl.inventory.canary import CanaryConfig

__all__ = [
    "REPORT_PROBE_GAP_S",
    "DaemonSummary",
    "HealthDaemon",
    "ReportOutcome",
    "WatchedWorker",
    "create_app",
    "freeze_heap",
    "run_daemon",
    "serve_api",
    "split_listen",
    "watched_workers",
]

_log = logging.getLogger("ftctl.canary")


# At most one report-triggered probe per worker per second: unbounded, a stream of
# reports would make the daemon probe one worker as fast as reports come. A failed probe still
# confirms itself at once (the fast path to UNHEALTHY, at most failure_threshold probes).
REPORT_PROBE_GAP_S = 1.0
# Answers in flight get this long at SIGTERM.
_SHUTDOWN_S = 2.0


@dataclass(frozen=True)
class WatchedWorker:
    """A worker the daemon watches: where to probe it and which GPUs it uses."""

    target: ProbeTarget
    node: str = "localhost"
    gpus: tuple[int, ...] = ()


def watched_workers(inventory: Inventory) -> list[WatchedWorker]:
    """Every inventory worker."""
    return [WatchedWorker(ProbeTarget(w.name, w.url, w.model), w.node, w.gpus)
            for w in inventory.workers]


@dataclass
class _Entry:
    worker: WatchedWorker
    health: WorkerHealth
    last: ProbeResult | None = None
    last_at: float | None = None
    probes: int = 0
    in_flight: bool = False
    report_probe_at: float | None = None  # when a report last triggered a probe
    published: tuple[HealthState, BreakerState] | None = None
    duration: Any = None  # its ftctl_health_check_duration_seconds child, looked up once


@dataclass(frozen=True)
class ReportOutcome:
    """What a passive report did."""

    accepted: bool
    workers: tuple[str, ...]
    states: dict[str, str] = field(default_factory=dict)
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "workers": list(self.workers),
                "states": self.states, "detail": self.detail}


@dataclass(frozen=True)
class DaemonSummary:
    """What `run_daemon` returns when stopped."""

    listen: str
    workers: int
    rounds: int
    probes: int
    transitions: int
    states: dict[str, int]


class HealthDaemon:
    """Probes, passive signals and per-worker state machines (see the module docstring)."""

    def __init__(
        self, workers: Sequence[WatchedWorker], canary_set: CanarySet, config: CanaryConfig, *,
        clock: Clock = SYSTEM_CLOCK, transport: AsyncTransport | None = None,
        baselines: Baselines | None = None,
        on_transition: Callable[[Transition], None] | None = None,
        on_action: Callable[[ActionOutcome], None] | None = None,
        metrics: bool = True, gate: ActingGate | None = None, allow_empty: bool = False,
    ) -> None:
        if not workers and not allow_empty:
            msg = "the canary daemon needs at least one worker"
            raise InvalidInput(msg)
        self.canary_set = canary_set
        self.config = config
        self.clock = clock
        self._own_transport = transport is None
        # One connection per request in flight: a probe sends its whole set at once.
        per_probe = len(canary_set.prompts) if config.parallel_prompts else 1
        self.transport: AsyncTransport = transport or ClientTransport(
            concurrency=config.concurrency * per_probe)
        self.baselines = baselines or Baselines()
        self.on_transition = on_transition
        self.on_action = on_action
        # Whether this daemon runs the actions (`health/acting.py`): always, alone.
        self.gate = gate or ActingGate(None)
        machine = MachineConfig.from_canary(config)
        self.entries: dict[str, _Entry] = {
            w.target.name: _Entry(w, WorkerHealth(w.target.name, machine, clock))
            for w in workers
        }
        # At most `concurrency` probe tasks; the other due probes wait in `_queued`, in
        # order, and each probe that ends starts the next. Not a semaphore: 10,000
        # tasks parked on one cost a task each and, in Python 3.11, a scan of the
        # waiters on every release.
        self._running = 0
        self._queued: collections.deque[_Entry] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._actions: set[asyncio.Task[None]] = set()  # of `_tasks`: transition actions
        self.rounds = 0
        self.probes = 0
        self.transitions = 0
        self._metrics = metrics
        if metrics:
            for entry in self.entries.values():
                self._publish(entry)

    def set_workers(self, workers: Sequence[WatchedWorker]) -> None:
        """Watch `workers` from now on (DNS discovery): one that stays keeps its state and
        breaker, a new one starts HEALTHY and is probed next round, one that left is
        forgotten (a probe of it in flight ends unrecorded here)."""
        machine = MachineConfig.from_canary(self.config)
        entries = {}
        for worker in workers:
            old = self.entries.get(worker.target.name)
            entries[worker.target.name] = old if old is not None and old.worker == worker \
                else _Entry(worker, WorkerHealth(worker.target.name, machine, self.clock))
        self.entries = entries
        if self._metrics:
            for entry in entries.values():
                self._publish(entry)

    # ------------------------------------------------------------------ probing

    def start_round(self) -> int:
        """Start a probe of every worker that is idle and whose breaker allows one."""
        self.rounds += 1
        started = 0
        for entry in self.entries.values():
            started += self._spawn_probe(entry)
        return started

    async def probe_round(self) -> int:
        """One round, waiting for it and every confirmation probe it caused."""
        started = self.start_round()
        await self.settle()
        return started

    async def settle(self) -> None:
        """Wait until no probe or action is in flight."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, job: Awaitable[None], *, action: bool = False) -> None:
        task = asyncio.ensure_future(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if action:
            self._actions.add(task)
            task.add_done_callback(self._actions.discard)

    def _spawn_probe(self, entry: _Entry) -> bool:
        if entry.in_flight or not entry.health.allow_probe():
            if self._metrics:
                self._publish(entry)
            return False
        entry.in_flight = True
        if self._metrics:
            self._publish(entry)
        if self._running < self.config.concurrency:
            self._running += 1
            self._spawn(self._probe(entry))
        else:
            self._queued.append(entry)
        return True

    def _start_next(self) -> None:
        """A probe ended: its slot goes to the next queued probe, if any."""
        if self._queued:
            self._spawn(self._probe(self._queued.popleft()))
        else:
            self._running -= 1

    async def _probe(self, entry: _Entry) -> None:
        try:
            result = await aprobe_worker(
                entry.worker.target, self.canary_set, self.config,
                transport=self.transport, baselines=self.baselines, clock=self.clock,
            )
        finally:
            entry.in_flight = False
            self._start_next()
        self.probes += 1
        entry.probes += 1
        entry.last = result
        entry.last_at = self.clock.wall()
        if self._metrics:
            if entry.duration is None:
                from dynamo_ftctl.metrics import HEALTH_CHECK_DURATION

                entry.duration = HEALTH_CHECK_DURATION.labels(entry.worker.target.name)
            entry.duration.observe(result.wall_s)
        self._apply(entry, entry.health.record(result.healthy, result.reason, "probe"))
        if not result.healthy:
            self._confirm(entry)

    def _confirm(self, entry: _Entry) -> bool:
        # Still counting failures with the breaker closed: ask again now, not next interval.
        health = entry.health
        if health.breaker is BreakerState.CLOSED and health.consecutive_failures > 0:
            return self._spawn_probe(entry)
        return False

    def _confirm_report(self, entry: _Entry) -> None:
        now = self.clock.now()
        last = entry.report_probe_at
        if last is not None and now - last < REPORT_PROBE_GAP_S:
            return
        if self._confirm(entry):
            entry.report_probe_at = now

    # ------------------------------------------------------------------ passive signals

    def report(self, body: Mapping[str, Any]) -> ReportOutcome:
        """A passive signal: `{"worker", "ok", "reason", "source"}` or a GPU event.

        `"ok": false` counts as a failure and asks for an early probe; `"ok": true`
        is taken (not an error) but changes nothing: only a passing probe restores.
        """
        source = body.get("source", "proxy")
        if source not in ("proxy", "gpu", "probe"):
            msg = f"'source' must be proxy or gpu, got {source!r}"
            raise InvalidInput(msg)
        names = self._report_targets(body)
        ok = body.get("ok", False)
        if not isinstance(ok, bool):
            msg = "'ok' must be true or false"
            raise InvalidInput(msg)
        if source == "gpu" and body.get("actionable") is False:
            return ReportOutcome(False, names, detail="GPU event needs no action")
        if ok:
            return ReportOutcome(False, names, {n: self.entries[n].health.state.value
                                                for n in names},
                                 detail="an ok report changes nothing: only a passing canary "
                                        "probe restores a worker")
        reason = str(body.get("reason") or f"reported by {source}")[:300]
        sig: SignalSource = "gpu" if source == "gpu" else "proxy"
        states = {}
        for name in names:
            entry = self.entries[name]
            self._apply(entry, entry.health.record(False, f"{source}: {reason}", sig))
            self._confirm_report(entry)
            states[name] = entry.health.state.value
        return ReportOutcome(True, names, states)

    def _report_targets(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        names: list[str] = []
        if isinstance(body.get("worker"), str):
            names.append(body["worker"])
        workers = body.get("workers")
        if isinstance(workers, list):
            names.extend(str(w) for w in workers)
        if not names and "gpu" in body:
            node, gpu = body.get("node"), body.get("gpu")
            names = [n for n, e in self.entries.items()
                     if (node is None or e.worker.node == node)
                     and isinstance(gpu, int) and gpu in e.worker.gpus]
        if not names:
            msg = "a report names a 'worker', 'workers', or a 'node' and 'gpu'"
            raise InvalidInput(msg)
        unknown = [n for n in names if n not in self.entries]
        if unknown:
            msg = f"unknown worker {unknown[0]!r}"
            raise InvalidInput(msg)
        return tuple(dict.fromkeys(names))

    # ------------------------------------------------------------------ transitions

    def _apply(self, entry: _Entry, transition: Transition | None) -> None:
        if self._metrics:
            self._publish(entry)
        if transition is None:
            return
        self.transitions += 1
        if self.on_transition is not None:
            self.on_transition(transition)
        self._act_on(transition)

    def _act_on(self, transition: Transition) -> None:
        """Run the actions of the state `transition` entered, when this daemon acts and no
        daemon has acted on that state of the worker yet (`ActingGate.acted`)."""
        gate = self.gate
        if not gate.acting or gate.acted(transition.worker) == transition.state.value:
            return
        gate.record(transition.worker, transition.state.value)
        session = getattr(self.transport, "session", None)
        for action in actions_for(self.config.actions, transition):
            if session is None:
                continue
            self._spawn(self._act(action, transition, session), action=True)

    def catch_up(self) -> None:
        """On taking the acting lock: act once on each worker whose current state has actions
        that no daemon ran (the old actor died before, or nobody acted meanwhile)."""
        for name, entry in self.entries.items():
            health = entry.health
            state = health.state
            acted = self.gate.acted(name)
            if acted == state.value or not actions_for(self.config.actions, Transition(
                    name, state, state, health.breaker, "", "probe", 0.0, 0.0)):
                continue
            try:
                previous = HealthState(acted) if acted is not None else state
            except ValueError:  # a record from another version: what it says is unknown
                previous = state
            self._act_on(Transition(
                worker=name, previous=previous, state=state, breaker=health.breaker,
                reason=f"taking over as the acting daemon: {health.last_reason or state.value}",
                source="probe", at=self.clock.wall(), weight=health.weight))

    async def _act(self, action: Any, transition: Transition, session: Any) -> None:
        outcome = await run_action(action, transition, session=session)
        if self.on_action is not None:
            self.on_action(outcome)

    def _publish(self, entry: _Entry) -> None:
        key = (entry.health.state, entry.health.breaker)
        if entry.published == key:
            return
        from dynamo_ftctl.metrics import CIRCUIT_BREAKER_STATE, WORKER_STATUS

        name = entry.worker.target.name
        for state in HealthState:
            WORKER_STATUS.labels(name, state.value).set(1 if state is key[0] else 0)
        CIRCUIT_BREAKER_STATE.labels(name).set(key[1].gauge)
        entry.published = key

    # ------------------------------------------------------------------ views

    def snapshot(self) -> dict[str, Any]:
        """`GET /workers`: states, weights, breakers and last results."""
        rows = []
        for name, entry in self.entries.items():
            health = entry.health
            last = entry.last
            rows.append({
                "name": name, "url": redact_url(entry.worker.target.url),
                "state": health.state.value,
                "weight": health.weight, "breaker": health.breaker.value,
                "consecutive_failures": health.consecutive_failures,
                "retry_in_s": health.retry_in(), "reason": health.last_reason,
                "probes": entry.probes,
                "last": None if last is None else {
                    "at": entry.last_at, "verdict": last.verdict, "kind": last.kind,
                    "reason": last.reason, "latency_s": last.latency_s,
                    "baseline_s": last.baseline_s,
                },
            })
        return {"updated": self.clock.wall(), "interval_s": self.config.interval_s,
                "acting": self.gate.acting, "set_kind": self.canary_set.kind,
                "set_note": self.canary_set.note, "workers": rows}

    def counts(self) -> dict[str, int]:
        """Workers per state."""
        out = {s.value: 0 for s in HealthState}
        for entry in self.entries.values():
            out[entry.health.state.value] += 1
        return out

    def render(self) -> Any:
        """A rich table of the fleet (the live view)."""
        from dynamo_ftctl.output import table

        colour = {"healthy": "green", "suspicious": "yellow", "unhealthy": "red",
                  "draining": "magenta", "dead": "bold red"}
        rows = []
        for name, entry in self.entries.items():
            h = entry.health
            last = entry.last
            latency = f"{last.latency_s * 1000:.0f} ms" if last and last.latency_s else "-"
            rows.append((name, f"[{colour[h.state.value]}]{h.state.value.upper()}[/]", h.weight,
                         h.breaker.value, latency, h.last_reason[:70]))
        counts = ", ".join(f"{k} {v}" for k, v in self.counts().items() if v)
        return table(f"canary daemon: {len(self.entries)} workers ({counts}); "
                     f"{self.canary_set.kind} set ({self.canary_set.note})",
                     ["worker", "state", "weight", "breaker", "latency", "reason"], rows)

    async def aclose(self) -> None:
        """Cancel the probes in flight, let the transition actions in flight end (each
        within its `timeout_s`, its outcome reported: a drain that was started is not
        lost from the record), then close the transport if it is ours."""
        for entry in self._queued:
            entry.in_flight = False
        self._queued.clear()
        while self._tasks:
            for task in list(self._tasks):
                if task not in self._actions:
                    task.cancel()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._own_transport and isinstance(self.transport, ClientTransport):
            await self.transport.close()

    async def run(self, stop: asyncio.Event, *, on_round: Callable[[], None] | None = None) -> None:
        """Start a round every `interval_s` until `stop` is set."""
        next_tick = self.clock.now()
        while not stop.is_set():
            self.start_round()
            if on_round is not None:
                on_round()
            next_tick += self.config.interval_s
            delay = max(0.0, next_tick - self.clock.now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)


def run_daemon(
    inventory: Inventory, canary_set: CanarySet, config: CanaryConfig, *,
    listen: str | None = None, store: BaselineStore | None = None,
    on_transition: Callable[[Transition], None] | None = None,
    on_action: Callable[[ActionOutcome], None] | None = None,
    on_ready: Callable[[str], None] | None = None, live: bool = False,
    acting_lock: Path | None = None,
) -> DaemonSummary:
    """Run the daemon and its HTTP API until SIGINT/SIGTERM (blocking). `acting_lock`
    (default: `config.acting_lock`): the lock whose holder runs the actions."""
    install_log_redaction()
    listen = listen or config.listen
    split_listen(listen)  # a malformed address fails before anything opens
    log_file = None
    if config.transition_log:
        path = inventory.resolve(config.transition_log)
        from dynamo_ftctl.safefiles import open_log

        try:  # a link, FIFO or device is refused (exit 2) before the daemon serves
            log_file = open_log(path)
        except OSError as exc:
            msg = f"{path}: cannot open the transition log: {exc.strerror or exc}"
            raise InvalidInput(msg) from None

    def transition(t: Transition) -> None:
        if log_file is not None:
            log_file.write(json.dumps(t.to_json(), separators=(",", ":")) + "\n")
        if on_transition is not None:
            on_transition(t)

    baselines = store.load() if store is not None else Baselines()

    if acting_lock is None and config.acting_lock is not None:
        acting_lock = inventory.resolve(config.acting_lock)
    gate = ActingGate(acting_lock)

    async def main() -> DaemonSummary:
        from dynamo_ftctl.discovery import Discovery, with_discovered

        discovery = Discovery(inventory.discovery)
        if inventory.discovery:  # the first answer is watched from the first round
            await discovery.refresh()
        daemon = HealthDaemon(watched_workers(with_discovered(inventory, discovery.workers)),
                              canary_set, config, baselines=baselines, on_transition=transition,
                              on_action=on_action, allow_empty=bool(inventory.discovery),
                              gate=gate)
        following = asyncio.ensure_future(discovery.run(lambda found: daemon.set_workers(
            watched_workers(with_discovered(inventory, found))))) if inventory.discovery \
            else None
        freeze_heap()
        try:
            server = await serve_api(daemon, listen, token=token_from_env(config.token_env))
        except InvalidInput:
            await daemon.aclose()
            raise
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # SIGHUP (a closed terminal, a log rotation's kick) must not end the probes.
        loop.add_signal_handler(signal.SIGHUP, _log.warning,
                                "SIGHUP: the canary daemon keeps its workers and goes on; "
                                "restart it to change them")
        url = server.address  # known while it listens, not after the shutdown
        if on_ready is not None:
            on_ready(url)
        saver = _every_interval(daemon, store)
        acting = asyncio.ensure_future(gate.hold(stop, daemon.catch_up))
        try:
            if live:
                await _run_live(daemon, stop, saver)
            else:
                await daemon.run(stop, on_round=saver)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await acting  # gives the lock back (a waiting daemon takes it at once)
            if following is not None:
                following.cancel()
            await server.shutdown(_SHUTDOWN_S)
            await daemon.aclose()
            if store is not None:
                store.merge(daemon.baselines)
        return DaemonSummary(url, len(daemon.entries), daemon.rounds, daemon.probes,
                             daemon.transitions, daemon.counts())

    from dynamo_ftctl.httpapp import loop_factory

    try:
        # uvloop when installed: a probe costs less CPU on it (docs/benchmarks.md).
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(main())
    finally:
        if log_file is not None:
            log_file.close()


def freeze_heap() -> None:
    """Move every object alive now (inventory, workers, metrics) out of the collector's view.

    They live as long as the daemon: the cyclic collector's full passes need not walk
    them again every few thousand probes, which with 10,000 workers is a large share of
    a round's CPU (docs/benchmarks.md). Garbage made later is collected as usual.
    """
    gc.collect()
    gc.freeze()


def _every_interval(daemon: HealthDaemon, store: BaselineStore | None) -> Callable[[], None]:
    def save() -> None:
        # Baselines reach the state file once per round (one-shot probes read them).
        if store is not None and daemon.rounds > 1:
            with contextlib.suppress(InvalidInput, OSError):
                store.merge(daemon.baselines)
    return save


async def _run_live(daemon: HealthDaemon, stop: asyncio.Event, saver: Callable[[], None]) -> None:
    from rich.live import Live

    from dynamo_ftctl.output import stdout_console

    with Live(daemon.render(), console=stdout_console(), refresh_per_second=2,
              transient=False) as view:
        runner = asyncio.ensure_future(daemon.run(stop, on_round=saver))
        try:
            while not stop.is_set():
                view.update(daemon.render())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
        finally:
            await runner

