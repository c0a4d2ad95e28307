"""`ftctl inventory`: check, show and describe the cluster inventory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode, load_inventory_for

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Check, show and describe the cluster inventory (YAML).\n\n"
        "Every command reads the inventory from -i/--inventory, $FTCTL_INVENTORY or "
        "./ftctl.yaml. Errors name the file, line and key and exit 2."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)

FileArg = Annotated[
    Path | None,
    typer.Argument(help="Inventory file (default: -i, $FTCTL_INVENTORY, ./ftctl.yaml).",
                   show_default=False),
]


@app.command()
def check(ctx: typer.Context, file: FileArg = None, json_: JsonFlag = False) -> None:
    """Validate an inventory: exit 0 when valid, 2 with file:line: key: reason otherwise.

    Example: ftctl inventory check examples/local.yaml
    """
    inventory = load_inventory_for(ctx, file)
    summary: dict[str, Any] = {
        "file": str(inventory.source),
        "valid": True,
        "cluster": inventory.cluster,
        "workers": len(inventory.workers),
        "groups": len(inventory.groups),
        "discovery": [source.dns for source in inventory.discovery],
    }
    if json_mode(ctx, json_):
        finish(ctx, summary, json_flag=True)
    sys.stdout.write(
        f"{file or inventory.source}: ok, cluster {inventory.cluster!r}, "
        f"{len(inventory.workers)} workers, {len(inventory.groups)} groups"
        + "".join(f", workers found in DNS at {source.dns}" for source in inventory.discovery)
        + "\n",
    )


@app.command()
def show(
    ctx: typer.Context, file: FileArg = None, json_: JsonFlag = False,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Ask every worker what it supports (token ids, /tokenize, /health, "
        "metrics, sleep, KV export, max_model_len): one row each, yes/no/? per capability. "
        "Exit 3 when a worker does not answer.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, max=60.0, help="Seconds each probe may take (with --probe).",
    )] = 3.0,
) -> None:
    """Show the workers of an inventory as a table, or the whole inventory with --json.

    With --probe, ask each worker what it supports instead; ? means it did not say.

    Example: ftctl -i examples/local.yaml inventory show

    Example: ftctl -i examples/local.yaml inventory show --probe --json
    """
    inventory = load_inventory_for(ctx, file)
    if probe:
        from dynamo_ftctl.capabilities import probe_inventory_sync

        report = probe_inventory_sync(inventory, timeout_s=timeout)
        finish(ctx, report, json_flag=json_, code=report.exit_code)
    if json_mode(ctx, json_):
        finish(ctx, inventory, json_flag=True)
    from dynamo_ftctl.output import plain_table, stdout_console, table

    rows = [
        (
            w.name, w.url, w.model, w.node, ",".join(map(str, w.gpus)) or "-",
            w.group or "-", ",".join(w.faults) or "-",
            "protected" if w.protected else ("sim" if w.launch and w.launch.sim else "-"),
        )
        for w in inventory.workers
    ]
    title = f"cluster {inventory.cluster} ({inventory.source})"
    headers = ["worker", "url", "model", "node", "gpus", "group", "faults", "notes"]
    if not sys.stdout.isatty():  # pipes and grep get whole values, not cells cut to 80 columns
        sys.stdout.write(f"# {title}\n" + plain_table(headers, rows))
        return
    stdout_console().print(table(title, headers, rows))


@app.command()
def schema() -> None:
    """Print the inventory's JSON Schema (for editors and CI validation)."""
    import json

    from dynamo_ftctl.inventory import inventory_json_schema

    sys.stdout.write(json.dumps(inventory_json_schema(), indent=2) + "\n")
