"""Options and glue shared by every command group (kept import-light)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import msgspec
import typer

from dynamo_ftctl.cli._light import inventory_path, load_chosen_inventory

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Inventory

__all__ = [
    "GlobalOptions",
    "JsonFlag",
    "finish",
    "json_mode",
    "load_inventory_for",
    "resolve_inventory_path",
]


class GlobalOptions(msgspec.Struct, frozen=True):
    """Options of the root command, available to every subcommand as `ctx.obj`."""

    inventory: Path | None = None
    json: bool = False
    debug: bool = False


# Every command that prints a result also takes --json after its own name.
JsonFlag = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else."),
]


def global_options(ctx: click.Context) -> GlobalOptions:
    """The root options, whichever context level asks."""
    root = ctx.find_root()
    obj = root.obj
    return obj if isinstance(obj, GlobalOptions) else GlobalOptions()


def json_mode(ctx: typer.Context, local_flag: bool = False) -> bool:
    """True when `--json` was given before or after the subcommand."""
    return local_flag or global_options(ctx).json


def resolve_inventory_path(ctx: typer.Context, explicit: Path | None = None) -> Path:
    """The inventory path: explicit flag, then `-i`/$FTCTL_INVENTORY, then ./ftctl.yaml."""
    return explicit if explicit is not None else inventory_path(global_options(ctx).inventory)


def load_inventory_for(ctx: typer.Context, explicit: Path | None = None) -> Inventory:
    """Load and validate the inventory the user pointed at (errors exit 2)."""
    chosen = explicit if explicit is not None else global_options(ctx).inventory
    return load_chosen_inventory(chosen)


def finish(ctx: typer.Context, result: Any, *, json_flag: bool = False, code: int = 0) -> None:
    """Render `result` for people or machines and exit with `code`."""
    from dynamo_ftctl.output import emit

    emit(result, json_mode=json_mode(ctx, json_flag))
    raise typer.Exit(code)
