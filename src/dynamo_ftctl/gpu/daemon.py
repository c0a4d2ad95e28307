"""What `ftctl gpu watch` and `gpu kmsg` run: a watcher's events fed to the caller,
counted, served as metrics and reported to the canary daemon.

- `open_backend`: NVML, or the scripted fake when `$FTCTL_FAKE_NVML` names a spec
  (demos and tests on hosts without GPUs).
- `resolve_pci_map`: the kernel log names GPUs by PCI bus id; the map to indexes comes
  from `--pci-map`, else NVML, else /proc/driver/nvidia.
- `MetricsServer`: `ftctl_xid_events_total` and the rest of the registry on `/metrics`,
  served by the package's HTTP server from a thread (the watchers block).
- `watch_nvml` / `watch_kernel_log`: one call each: open what the source needs, feed
  every event to `on_event`, report actionable ones, stop after `count` events (or at
  the end of a log, or `duration_s`), close everything, return a `FeedSummary`.

Nothing here prints: events go to `on_event`, advice to `on_warning`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.auth import DAEMON_TOKEN_ENV
from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap, count_xid

if TYPE_CHECKING:
    from dynamo_ftctl.gpu.nvml import NvmlBackend
    from dynamo_ftctl.httpapp import BackgroundServer, Router
    from dynamo_ftctl.httpserver import Reply, Request

__all__ = [
    "FAKE_ENV", "FeedOptions", "FeedSummary", "MetricsServer", "open_backend",
    "resolve_pci_map", "watch_kernel_log", "watch_nvml",
]

FAKE_ENV = "FTCTL_FAKE_NVML"


def open_backend(clock: Clock = SYSTEM_CLOCK) -> NvmlBackend:
    """The scripted fake when $FTCTL_FAKE_NVML names a spec, else the real NVML
    (`Unreachable` without a driver)."""
    spec = os.environ.get(FAKE_ENV)
    if spec:
        from dynamo_ftctl.gpu.fake import load_fake_nvml

        return load_fake_nvml(Path(spec), clock=clock)
    from dynamo_ftctl.gpu.nvml import open_nvml

    return open_nvml()


def resolve_pci_map(explicit: str | None, clock: Clock = SYSTEM_CLOCK) -> dict[str, int]:
    """PCI bus id -> GPU index: `explicit` (`BUS=INDEX,...`), else NVML, else procfs."""
    from dynamo_ftctl.gpu.kmsg import parse_pci_map, pci_map_from_nvml, pci_map_from_procfs

    if explicit:
        return parse_pci_map(explicit)
    try:
        nvml = open_backend(clock)
    except Unreachable:
        return pci_map_from_procfs()
    try:
        return pci_map_from_nvml(nvml)
    except Unreachable:
        return pci_map_from_procfs()
    finally:
        nvml.close()


class MetricsServer:
    """The metrics registry on `/metrics` (and `/`), from a thread of its own."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._server: BackgroundServer | None = None

    def app(self) -> Router:
        from dynamo_ftctl.httpapp import Router, metrics_reply

        async def metrics(_: Request) -> Reply:
            from dynamo_ftctl.metrics import XID, registry_for

            return metrics_reply(registry_for(XID))

        router = Router()
        router.get("/metrics", metrics)
        router.get("/", metrics)  # as prometheus_client's own server did
        return router

    def start(self) -> MetricsServer:
        """Listen (`port` 0: a free one, known afterwards); `InvalidInput` if it cannot."""
        from dynamo_ftctl.httpapp import BackgroundServer

        server = BackgroundServer(self.app(), self.host, self.port)
        try:
            server.start()
        except OSError as exc:
            msg = (f"--metrics-port {self.port}: cannot listen on {self.host}:{self.port}: "
                   f"{exc.strerror or exc}")
            raise InvalidInput(msg) from None
        self._server = server
        self.port = server.port
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@dataclass(frozen=True)
class FeedOptions:
    """Where events come from and go, for either source."""

    node: str
    workers: WorkerMap = field(default_factory=WorkerMap)
    report_url: str | None = None  # the canary daemon (POST /report per affected worker)
    token: str | None = None  # its bearer token
    token_env: str = DAEMON_TOKEN_ENV  # where the token came from (named in the warning)
    count: int | None = None  # stop after this many events
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True)
class FeedSummary:
    """What a watch saw; `lines`, `xids` and `malformed` are the kernel log's only."""

    events: int
    actionable: int
    lines: int = 0
    xids: int = 0
    malformed: int = 0


def _check_node(options: FeedOptions, on_warning: Callable[[str], None]) -> None:
    nodes = options.workers.nodes
    if nodes and options.node not in nodes:
        on_warning(f"node {options.node!r} is not in the inventory (nodes: "
                   f"{', '.join(sorted(nodes))}); events will name no workers (use --node)")


def _feed(events: Iterator[GpuEvent], options: FeedOptions,
          on_event: Callable[[GpuEvent], None], on_warning: Callable[[str], None]) -> FeedSummary:
    """Count, hand on and report each event until `options.count`; close `events`."""
    reporter = None
    if options.report_url:
        from dynamo_ftctl.gpu.report import CanaryReporter

        if options.token is None:
            on_warning(f"${options.token_env} is not set: the canary daemon will refuse "
                       "these reports")
        reporter = CanaryReporter(options.report_url, token=options.token)
    seen = actionable = 0
    try:
        for event in events:
            count_xid(event)
            on_event(event)
            if reporter is not None:
                reporter.report(event)
            seen += 1
            actionable += event.actionable
            if options.count is not None and seen >= options.count:
                break
    finally:
        # Close the generator chain now (stops journalctl, closes files), not at GC.
        close = getattr(events, "close", None)
        if callable(close):
            close()
        if reporter is not None:
            reporter.close()
    return FeedSummary(seen, actionable)


def _metrics(options: FeedOptions) -> MetricsServer | None:
    if options.metrics_port is None:
        return None
    return MetricsServer(options.metrics_host, options.metrics_port).start()


def watch_nvml(options: FeedOptions, *, interval_s: float, duration_s: float | None,
               on_event: Callable[[GpuEvent], None], on_warning: Callable[[str], None],
               clock: Clock = SYSTEM_CLOCK) -> FeedSummary:
    """NVML's Xid events and polled changes (`gpu.watch.GpuWatcher`) until `count`
    events or `duration_s` seconds."""
    from dynamo_ftctl.gpu.watch import GpuWatcher

    _check_node(options, on_warning)
    nvml = open_backend(clock)
    metrics: MetricsServer | None = None
    try:
        metrics = _metrics(options)
        watcher = GpuWatcher(nvml, node=options.node, clock=clock, workers=options.workers,
                             poll_interval_s=interval_s)
        deadline = None if duration_s is None else clock.now() + duration_s

        def stop() -> bool:
            return deadline is not None and clock.now() >= deadline

        return _feed(watcher.run(stop), options, on_event, on_warning)
    finally:
        if metrics is not None:
            metrics.stop()
        nvml.close()


def watch_kernel_log(options: FeedOptions, *, source: str, follow: bool,
                     pci_map: str | None, poll_s: float,
                     on_event: Callable[[GpuEvent], None], on_warning: Callable[[str], None],
                     clock: Clock = SYSTEM_CLOCK) -> FeedSummary:
    """NVRM Xid lines of the kernel log (`source`: kmsg, journal, a file or -) as events,
    to the log's end unless `follow`."""
    from dynamo_ftctl.gpu.kmsg import KmsgWatcher, source_lines

    _check_node(options, on_warning)
    mapping = resolve_pci_map(pci_map, clock)
    if not mapping and options.workers.nodes:
        on_warning("no PCI bus id → GPU map (no NVML, no /proc/driver/nvidia, no --pci-map): "
                   "an Xid names every worker of the node")
    metrics = _metrics(options)
    try:
        watcher = KmsgWatcher(node=options.node, clock=clock, pci_map=mapping,
                              workers=options.workers)
        lines = source_lines(source, follow=follow, clock=clock, poll_s=poll_s)
        fed = _feed(watcher.events(lines), options, on_event, on_warning)
    finally:
        if metrics is not None:
            metrics.stop()
    parser = watcher.parser
    return FeedSummary(fed.events, fed.actionable, parser.lines, parser.xids, parser.malformed)
