"""`ftctl gpu`: GPU status, NVML and kernel-log Xid watchers, fleet failure math.

Thin glue: parse options, call one function of `dynamo_ftctl.gpu` (the watchers:
`gpu.daemon`), render, exit. NVML (pynvml), the HTTP stack and prometheus_client load only
in the commands that use them. `FTCTL_FAKE_NVML=spec.json` swaps NVML for the
scripted fake (`gpu/fake.py`), for demos and tests on hosts without GPUs.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, global_options, json_mode
from dynamo_ftctl.cli._light import optional_inventory

if TYPE_CHECKING:
    from dynamo_ftctl.gpu.daemon import FeedOptions
    from dynamo_ftctl.gpu.events import GpuEvent

__all__ = ["app"]

app = typer.Typer(
    help=(
        "GPU health: NVML status, Xid/ECC/throttle watchers (NVML events or the kernel "
        "log), and fleet failure math.\n\n"
        "NVML needs the gpu extra: pip install 'dynamo-ftctl[gpu]'.\n"
        "Exit codes: 0 healthy / nothing actionable, 1 a GPU problem or an actionable "
        "event, 2 bad usage or no gpu extra (pynvml), 3 no NVML library, driver or log "
        "source, 130 interrupted."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)

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


def _options(ctx: typer.Context, *, node: str | None, report: str | None, count: int | None,
             metrics_port: int | None, metrics_host: str) -> FeedOptions:
    """The options both watchers share, with the daemon token the inventory names."""
    from dynamo_ftctl.auth import DAEMON_TOKEN_ENV, token_from_env
    from dynamo_ftctl.gpu.daemon import FeedOptions
    from dynamo_ftctl.gpu.events import WorkerMap

    # Workers from the inventory when one is given or ./ftctl.yaml exists; else none.
    inventory = optional_inventory(global_options(ctx).inventory, required=False)
    token_env = inventory.canary.token_env if inventory is not None else DAEMON_TOKEN_ENV
    return FeedOptions(
        node=node or socket.gethostname(),
        workers=WorkerMap() if inventory is None else WorkerMap(inventory), report_url=report,
        token=token_from_env(token_env) if report else None, token_env=token_env,
        count=count, metrics_port=metrics_port, metrics_host=metrics_host,
    )


def _printer(ctx: typer.Context, json_flag: bool) -> Callable[[GpuEvent], None]:
    """One line per event (JSON with --json), flushed at once."""
    import json

    machine = json_mode(ctx, json_flag)

    def show(event: GpuEvent) -> None:
        # `to_json()` is JSON-native already, so this skips output.emit_line's generic
        # conversion, a large share of a long log scan's run time (docs/benchmarks.md).
        text = json.dumps(event.to_json(), separators=(",", ":")) if machine else (
            event.describe())
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    return show


def _warn(message: str) -> None:
    from dynamo_ftctl.output import warn

    warn(message)


@app.command()
def status(ctx: typer.Context, json_: JsonFlag = False) -> None:
    """Per-GPU name, UUID, PCI id, utilisation, memory, temperature, power, ECC, row
    remapping, decoded throttle reasons and NVLink state; exit 1 if a GPU has a problem.

    Example: ftctl gpu status --json
    """
    from dynamo_ftctl.gpu.daemon import open_backend
    from dynamo_ftctl.gpu.status import read_status

    nvml = open_backend()
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
    from dynamo_ftctl.gpu.daemon import watch_nvml

    options = _options(ctx, node=node, report=report, count=count, metrics_port=metrics_port,
                       metrics_host=metrics_host)
    summary = watch_nvml(options, interval_s=interval, duration_s=duration,
                         on_event=_printer(ctx, json_), on_warning=_warn)
    raise typer.Exit(1 if summary.actionable else 0)


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
    from dynamo_ftctl.gpu.daemon import watch_kernel_log

    options = _options(ctx, node=node, report=report, count=count, metrics_port=metrics_port,
                       metrics_host=metrics_host)
    summary = watch_kernel_log(options, source=source, follow=follow, pci_map=pci_map,
                               poll_s=poll_interval, on_event=_printer(ctx, json_),
                               on_warning=_warn)
    sys.stderr.write(
        f"{summary.lines} lines read, {summary.xids} Xid events ({summary.actionable} "
        f"actionable), {summary.malformed} malformed lines skipped\n"
    )
    raise typer.Exit(1 if summary.actionable else 0)


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
