"""`ftctl proxy`: the migrating, load-shedding front door over the inventory's workers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, load_inventory_for

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Serve an OpenAI-compatible front door over the inventory's workers: streams broken "
        "by a worker failure go on from another worker with no token lost or repeated, and "
        "load is shed (503/529 + Retry-After) when every worker is busy.\n\n"
        "Settings come from the inventory's `proxy:` section; flags override them."
    ),
    rich_markup_mode=None,
)


@app.command()
def proxy(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    listen: Annotated[str | None, typer.Option(
        "--listen", help="HOST:PORT to serve on (default: proxy.listen, 127.0.0.1:8000).")] = None,
    migration_limit: Annotated[int | None, typer.Option(
        "--migration-limit", min=0, max=100,
        help="Continuations per request; 0 disables migration (default 3).")] = None,
    stall_timeout: Annotated[float | None, typer.Option(
        "--stall-timeout", min=0.001, help="Seconds without a token before a worker has failed.",
    )] = None,
    health_url: Annotated[list[str] | None, typer.Option(
        "--health-url", help="Canary daemon base URL (weights from GET /workers; failures "
        "POSTed to /report with the bearer token in $FTCTL_DAEMON_TOKEN, or the variable "
        "proxy.health_token_env names). Repeatable: weights from the first daemon that "
        "answers, failures reported to each; none answering, the proxy's own breakers.",
        show_default=False)] = None,
    reject_status: Annotated[int | None, typer.Option(
        "--reject-status", help="503 or 529 when every worker is busy.")] = None,
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", metavar="FILE",
        help="Calibration file (`ftctl migrate calibrate`): move a live failed worker's KV "
             "when the cost model says a transfer beats re-prefill (default: "
             "proxy.calibration; none: always re-prefill).")] = None,
    max_connections: Annotated[int | None, typer.Option(
        "--max-connections", min=1,
        help="Client connections at most; one more is answered 503 and closed (default: "
             "proxy.max_connections, else what the open-file limit leaves room for, at most "
             "4096).")] = None,
    max_buffered_mib: Annotated[int | None, typer.Option(
        "--max-buffered-mib", min=1,
        help="MiB of requests not yet answered (partial bodies included, and what each "
             "generation's body is parsed into: 7 bytes more for each of its bytes) held "
             "across all clients; the request that would go over is answered 503 with "
             "Retry-After (default: proxy.max_buffered_mib, 256).")] = None,
    procs: Annotated[int | None, typer.Option(
        "--procs", min=1, max=256,
        help="Processes serving the port (SO_REUSEPORT; a parent restarts any that dies), "
             "with one view of the workers' health and busy state and one /metrics "
             "(default: proxy.procs, 1).")] = None,
    routing: Annotated[str | None, typer.Option(
        "--routing", metavar="POLICY",
        help="least_outstanding (the fewest requests in flight, per health weight) or "
             "cache_aware (where the prompt's longest prefix was served, so the engine's "
             "prefix cache hits; the least loaded worker once the load is out of balance, "
             "proxy.cache_aware's thresholds) (default: proxy.routing, least_outstanding).",
    )] = None,
    json_: JsonFlag = False,
) -> None:
    """Run the migrating proxy until Ctrl-C (or SIGTERM: answers in flight finish).

    SIGHUP reloads the inventory: workers added, removed or changed without dropping a
    stream (streams on a removed worker run to their end); a file that does not load
    keeps the workers as they were and logs one line. Workers found in DNS (the
    inventory's discovery:) join and leave the same way as the answers change.

    POST /busy_threshold needs Authorization: Bearer $FTCTL_ADMIN_TOKEN (or the variable
    proxy.admin_token_env names; 403 while it is unset).

    Example: ftctl -i examples/local.yaml proxy --listen 127.0.0.1:8000 --stall-timeout 5
    """
    from dynamo_ftctl.inventory.proxy import ProxyConfig
    from dynamo_ftctl.proxy.serve import serve
    from dynamo_ftctl.structs import convert_struct, to_data

    inventory = load_inventory_for(ctx)
    overrides: dict[str, Any] = {
        "listen": listen, "migration_limit": migration_limit, "stall_timeout_s": stall_timeout,
        "health_url": (None if not health_url else health_url[0] if len(health_url) == 1
                       else tuple(health_url)),
        "reject_status": reject_status,
        "calibration": str(calibration.resolve()) if calibration is not None else None,
        "max_connections": max_connections, "max_buffered_mib": max_buffered_mib,
        "procs": procs, "routing": routing,
    }
    data = to_data(inventory.proxy)
    data.update({k: v for k, v in overrides.items() if v is not None})
    # A bad value is `InventoryError` (exit 2) naming the proxy key it went to.
    config = convert_struct(data, ProxyConfig)

    def ready(url: str) -> None:
        procs_note = f" ({config.procs} processes)" if config.procs > 1 else ""
        sys.stderr.write(f"ftctl proxy: serving {len(inventory.workers)} workers on {url}"
                         f"{procs_note}\n")
        sys.stderr.flush()

    result = serve(inventory, config, on_ready=ready,
                   reload=lambda: load_inventory_for(ctx))
    finish(ctx, result, json_flag=json_)
