"""`ftctl gpu`: GPU status, NVML and kernel-log Xid watchers, fleet failure math.

Thin glue: parse options, build the library objects of `dynamo_ftctl.gpu`,
render. NVML (pynvml), httpx and prometheus_client load only in the commands
that use them. `FTCTL_FAKE_NVML=spec.json` swaps NVML for the scripted fake
(`gpu/fake.py`), for demos and tests on hosts without GPUs.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, global_options, json_mode
from dynamo_ftctl.cli._light import optional_inventory

if TYPE_CHECKING:
    from dynamo_ftctl.clock import Clock
    from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap
    from dynamo_ftctl.gpu.nvml import NvmlBackend

app = typer.Typer(
    help=(
        "GPU health: NVML status, Xid/ECC/throttle watchers (NVML events or the kernel "
        "log), and fleet failure math.\n\n"
        "NVML needs the gpu extra: pip install 'dynamo-ftctl[gpu]'.\n"
        "Exit codes: 0 healthy / nothing actionable, 1 a GPU problem or an actionable "
        "event, 2 bad usage, 3 no NVML, driver or log source, 130 interrupted."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)

FAKE_ENV = "FTCTL_FAKE_NVML"

NodeOpt = Annotated[
    str | None,
    typer.Option("--node", help="This host's node name in the inventory (default: hostname).",
                 show_default=False),
]
ReportOpt = Annotated[
    str | None,
    typer.Option("--report", metavar="URL",
                 help="Canary daemon URL: POST /report for each affected worker, with the "
                      "bearer token in $FTCTL_DAEMON_TOKEN (or the variable the inventory's "
                      "canary.token_env names).",
                 show_default=False),
]
CountOpt = Annotated[
    int | None,
    typer.Option("--count", min=1, help="Stop after this many events.", show_default=False),
]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option("--metrics-port", min=1, max=65535,
                 help="Serve ftctl_xid_events_total on this port (/metrics).",
                 show_default=False),
]
MetricsHostOpt = Annotated[
    str, typer.Option("--metrics-host", help="Address for --metrics-port."),
]


def _backend(clock: Clock) -> NvmlBackend:
    """The scripted fake when $FTCTL_FAKE_NVML names a spec, else the real NVML."""
    spec = os.environ.get(FAKE_ENV)
    if spec:
        from dynamo_ftctl.gpu.fake import load_fake_nvml

        return load_fake_nvml(Path(spec), clock=clock)
    from dynamo_ftctl.gpu.nvml import open_nvml

    return open_nvml()


def _workers(ctx: typer.Context) -> WorkerMap:
    """Workers from the inventory when one is given or ./ftctl.yaml exists; else none."""
    from dynamo_ftctl.gpu.events import WorkerMap

    inventory = optional_inventory(global_options(ctx).inventory, required=False)
    return WorkerMap() if inventory is None else WorkerMap(inventory)


def _node(node: str | None, workers: WorkerMap) -> str:
    chosen = node or socket.gethostname()
    if workers.nodes and chosen not in workers.nodes:
        from dynamo_ftctl.output import warn

        warn(
            f"node {chosen!r} is not in the inventory (nodes: {', '.join(sorted(workers.nodes))})"
            "; events will name no workers (use --node)"
        )
    return chosen


def _serve_metrics(port: int | None, host: str) -> None:
    if port is None:
        return
    from prometheus_client import start_http_server

    from dynamo_ftctl.metrics import REGISTRY

    start_http_server(port, addr=host, registry=REGISTRY)


def _stream(
    ctx: typer.Context, events: Iterator[GpuEvent], *, json_flag: bool, report: str | None,
    count: int | None,
) -> int:
    """Print, count and report events; the number of actionable ones."""
    import json

    from dynamo_ftctl.gpu.events import count_xid

    machine = json_mode(ctx, json_flag)
    reporter = None
    if report:
        from dynamo_ftctl.auth import DAEMON_TOKEN_ENV, token_from_env
        from dynamo_ftctl.gpu.report import CanaryReporter
        from dynamo_ftctl.output import warn

        inventory = optional_inventory(global_options(ctx).inventory, required=False)
        token_env = inventory.canary.token_env if inventory is not None else DAEMON_TOKEN_ENV
        token = token_from_env(token_env)
        if token is None:
            warn(f"${token_env} is not set: the canary daemon will refuse these reports")
        reporter = CanaryReporter(report, token=token)
    seen = actionable = 0
    try:
        for event in events:
            count_xid(event)
            # One JSON line per event, flushed at once. `to_json()` is JSON-native already,
            # so this skips output.emit_line's generic conversion: on a 1M-line log scan
            # that conversion was a third of the run time (benchmarks/xid.py).
            text = json.dumps(event.to_json(), separators=(",", ":")) if machine else (
                event.describe())
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            if reporter is not None:
                reporter.report(event)
            seen += 1
            actionable += event.actionable
            if count is not None and seen >= count:
                break
    finally:
        # Close the generator chain now (stops journalctl, closes files), not at GC.
        close = getattr(events, "close", None)
        if callable(close):
            close()
        if reporter is not None:
            reporter.close()
    return actionable


@app.command()
def status(ctx: typer.Context, json_: JsonFlag = False) -> None:
    """Per-GPU name, UUID, PCI id, utilisation, memory, temperature, power, ECC, row
    remapping, decoded throttle reasons and NVLink state; exit 1 if a GPU has a problem.

    Example: ftctl gpu status --json
    """
    from dynamo_ftctl.clock import SYSTEM_CLOCK
    from dynamo_ftctl.gpu.status import read_status

    nvml = _backend(SYSTEM_CLOCK)
    try:
        report = read_status(nvml)
    finally:
        nvml.close()
    finish(ctx, report, json_flag=json_, code=0 if report.healthy else 1)


@app.command()
def watch(
    ctx: typer.Context,
    *,
    interval: Annotated[
        float, typer.Option("--interval", min=0.01, help="Seconds between ECC/remap/throttle "
                            "polls; Xid events arrive at once."),
    ] = 1.0,
    node: NodeOpt = None,
    report: ReportOpt = None,
    count: CountOpt = None,
    duration: Annotated[
        float | None,
        typer.Option("--duration", min=0.0, help="Stop after this many seconds.",
                     show_default=False),
    ] = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
    json_: JsonFlag = False,
) -> None:
    """Watch NVML: Xid critical errors as they happen, plus polled ECC, row-remap,
    throttle and NVLink changes; one line (JSON with --json) per event, with the
    catalog action and the inventory workers on that GPU.

    Example: ftctl -i cluster.yaml gpu watch --node node-a --report http://127.0.0.1:9400 --json
    """
    from dynamo_ftctl.clock import SYSTEM_CLOCK
    from dynamo_ftctl.gpu.watch import GpuWatcher

    workers = _workers(ctx)
    chosen = _node(node, workers)
    nvml = _backend(SYSTEM_CLOCK)
    try:
        _serve_metrics(metrics_port, metrics_host)
        watcher = GpuWatcher(
            nvml, node=chosen, clock=SYSTEM_CLOCK, workers=workers, poll_interval_s=interval,
        )
        deadline = None if duration is None else SYSTEM_CLOCK.now() + duration

        def stop() -> bool:
            return deadline is not None and SYSTEM_CLOCK.now() >= deadline

        actionable = _stream(
            ctx, watcher.run(stop), json_flag=json_, report=report, count=count,
        )
    finally:
        nvml.close()
    raise typer.Exit(1 if actionable else 0)


def _pci_map(explicit: str | None, clock: Clock) -> dict[str, int]:
    from dynamo_ftctl.errors import Unreachable
    from dynamo_ftctl.gpu.kmsg import parse_pci_map, pci_map_from_nvml, pci_map_from_procfs

    if explicit:
        return parse_pci_map(explicit)
    try:
        nvml = _backend(clock)
    except Unreachable:
        return pci_map_from_procfs()
    try:
        return pci_map_from_nvml(nvml)
    except Unreachable:
        return pci_map_from_procfs()
    finally:
        nvml.close()


@app.command()
def kmsg(
    ctx: typer.Context,
    *,
    source: Annotated[
        str, typer.Option("--source", "-s", help="kmsg (/dev/kmsg), journal (journalctl -k), "
                          "a log FILE, or - for stdin."),
    ] = "kmsg",
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep reading new lines (like tail -F)."),
    ] = False,
    pci_map: Annotated[
        str | None,
        typer.Option("--pci-map", metavar="BUS=INDEX,...",
                     help="PCI bus id → GPU index, e.g. 0000:3b:00=0 (default: NVML, "
                          "then /proc/driver/nvidia).", show_default=False),
    ] = None,
    node: NodeOpt = None,
    report: ReportOpt = None,
    count: CountOpt = None,
    poll_interval: Annotated[
        float, typer.Option("--poll-interval", min=0.001,
                            help="Seconds between checks of a followed file."),
    ] = 0.01,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
    json_: JsonFlag = False,
) -> None:
    """Find NVRM Xid lines in the kernel log and emit the same events as `gpu watch`.

    A file or stdin is read to its end and the command exits (1 if an actionable
    Xid was found), unless --follow. Malformed lines are skipped and counted.

    Example: ftctl gpu kmsg --source /var/log/kern.log --json
    """
    from dynamo_ftctl.clock import SYSTEM_CLOCK
    from dynamo_ftctl.gpu.kmsg import KmsgWatcher, source_lines
    from dynamo_ftctl.output import warn

    workers = _workers(ctx)
    chosen = _node(node, workers)
    mapping = _pci_map(pci_map, SYSTEM_CLOCK)
    if not mapping and workers.nodes:
        warn("no PCI bus id → GPU map (no NVML, no /proc/driver/nvidia, no --pci-map): "
             "an Xid names every worker of the node")
    _serve_metrics(metrics_port, metrics_host)
    watcher = KmsgWatcher(node=chosen, clock=SYSTEM_CLOCK, pci_map=mapping, workers=workers)
    lines = source_lines(source, follow=follow, clock=SYSTEM_CLOCK, poll_s=poll_interval)
    actionable = _stream(
        ctx, watcher.events(lines), json_flag=json_, report=report, count=count,
    )
    parser = watcher.parser
    sys.stderr.write(
        f"{parser.lines} lines read, {parser.xids} Xid events ({actionable} actionable), "
        f"{parser.malformed} malformed lines skipped\n"
    )
    raise typer.Exit(1 if actionable else 0)


@app.command()
def mtbf(
    ctx: typer.Context,
    *,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs in the fleet.")],
    afr: Annotated[
        float, typer.Option("--afr", help="Annualised failure rate per GPU, 0.03 = 3%."),
    ],
    group_size: Annotated[
        int, typer.Option("--group-size", min=1, help="GPUs per TP/PP group (fail as a unit)."),
    ] = 8,
    request_seconds: Annotated[
        float, typer.Option("--request-seconds", help="Length of one request."),
    ] = 30.0,
    repair_hours: Annotated[
        float, typer.Option("--repair-hours", help="Time to bring a failed group back."),
    ] = 24.0,
    confidence: Annotated[
        float, typer.Option("--confidence", help="Confidence that spares cover the failures."),
    ] = 0.999,
    json_: JsonFlag = False,
) -> None:
    """Fleet MTBF, failures per day (fleet and per group), the risk that a request meets
    a failure, and the spare groups that keep degradation at level 0 (Poisson).

    Example: ftctl gpu mtbf --gpus 1024 --afr 0.03 --group-size 8 --request-seconds 30
    """
    from dynamo_ftctl.gpu.mtbf import fleet_reliability

    result = fleet_reliability(
        gpus=gpus, afr=afr, group_size=group_size, request_seconds=request_seconds,
        repair_hours=repair_hours, confidence=confidence,
    )
    finish(ctx, result, json_flag=json_)
