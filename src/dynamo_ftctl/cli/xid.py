"""`ftctl xid`: explain an NVIDIA Xid code, or list the catalog."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

import typer

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode

__all__ = ["app"]

app = typer.Typer(
    help=(
        "Explain an NVIDIA Xid error code: meaning, likely cause and what to do "
        "(NVIDIA's Xid catalog).\n\n"
        "Exit codes: 0 known code, 2 unknown code or no code given."
    ),
    rich_markup_mode=None,
)


def _doc(info: Any) -> dict[str, Any]:
    doc = asdict(info)
    doc["action"] = info.action.value
    doc["action_summary"] = info.action.summary
    return doc


@app.command()
def xid(
    ctx: typer.Context,
    code: Annotated[
        int | None, typer.Argument(help="The Xid number, e.g. 48.", show_default=False),
    ] = None,
    list_: Annotated[
        bool, typer.Option("--list", "-l", help="Show every cataloged Xid as a table."),
    ] = False,
    json_: JsonFlag = False,
) -> None:
    """Explain one Xid (`ftctl xid 48`) or list the catalog (`ftctl xid --list`).

    Example: ftctl xid 79 --json
    """
    from dynamo_ftctl.errors import InvalidInput
    from dynamo_ftctl.xid import XID_CATALOG, lookup_xid

    machine = json_mode(ctx, json_)
    if list_:
        rows = [XID_CATALOG[c] for c in sorted(XID_CATALOG)]
        if machine:
            finish(ctx, [_doc(info) for info in rows], json_flag=True)
        from dynamo_ftctl.output import stdout_console, table

        stdout_console().print(table(
            "NVIDIA Xid catalog (actionable codes)",
            ["xid", "meaning", "action", "effect"],
            [(i.code, i.meaning, i.action.value, i.effect) for i in rows],
        ))
        raise typer.Exit(0)
    if code is None:
        msg = "give an Xid code (ftctl xid 48) or --list"
        raise InvalidInput(msg)
    info = lookup_xid(code)
    if machine:
        finish(ctx, _doc(info), json_flag=True)
    from dynamo_ftctl.output import kv_table, stdout_console

    stdout_console().print(kv_table(f"Xid {info.code}: {info.meaning}", {
        "mnemonic": info.name,
        "likely cause": info.cause,
        "action": f"{info.action.value}: {info.action.summary}",
        "serving effect": info.effect,
        "source": info.source,
    }))
