"""`ftctl inject`: inject a fault into one inventory worker, revert it, run the TCP fault proxy.

`ftctl inject <fault> --worker NAME` is the default command of this group:
a first argument that is not a subcommand (`revert`, `netproxy`) is a fault.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from click.shell_completion import CompletionItem
from typer.core import TyperGroup

from dynamo_ftctl.cli._common import JsonFlag, finish, json_mode, load_inventory_for
from dynamo_ftctl.cli.completion import complete_worker, fault_items


class _FaultGroup(TyperGroup):
    """Dispatch `ftctl inject FAULT ...` to the hidden `fault` command."""

    def resolve_command(self, ctx: click.Context, args: list[str],
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        # After the group's own options (`inject -i inv.yaml kill`), the first word that
        # is not a subcommand is a fault: the `fault` command takes it as its argument.
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            return "fault", self.commands["fault"], args
        return super().resolve_command(ctx, args)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        # `ftctl inject <TAB>`: the first word is a fault as often as a subcommand.
        return [*fault_items(ctx, incomplete), *super().shell_complete(ctx, incomplete)]


__all__ = ["app"]

app = typer.Typer(
    cls=_FaultGroup,
    help=(
        "Inject a fault into one inventory worker: ftctl inject FAULT --worker NAME.\n\n"
        "Only inventory workers, only faults in their `faults` allowlist, never a "
        "`protected` worker (refusals exit 2, nothing done). --dry-run prints every step; "
        "--duration reverts by itself; destructive faults need --yes off a terminal. Every "
        "injection and revert is appended to the audit log.\n\n"
        "Example: ftctl -i drills/local.yaml inject slow --worker w2 --delay-ms 80 --duration 30s"
        "\n\noverload runs a bounded background load (--rate, --concurrency) against the "
        "worker until --duration or `ftctl inject revert`."
        "\n\nA worker without an admin API (vLLM): kill, term, hang by signal (process.group: "
        "true signals its whole process group), net-* through the TCP fault proxy; xid<N> "
        "writes the driver's Xid line (kmsg or dcgm injector, required) then SIGKILLs (or, "
        "for a hang Xid, SIGSTOPs) it; slow, sdc, disconnect and contained Xids are refused."
    ),
    invoke_without_command=True,
    rich_markup_mode=None,
)

AuditOpt = Annotated[
    Path | None,
    typer.Option("--audit-log", help="Audit log (JSON lines; default "
                 "$XDG_STATE_HOME/ftctl/audit.jsonl): appended to a regular file with one link "
                 "or made new; a link, FIFO or device is refused.", show_default=False),
]
StateOpt = Annotated[
    Path | None,
    typer.Option("--state-dir", help="Where pending reverts are kept (default "
                 "$XDG_STATE_HOME/ftctl).", show_default=False),
]


@app.callback()
def inject_root(
    ctx: typer.Context,
    list_: Annotated[bool, typer.Option("--list", help="List every fault and exit.")] = False,
    json_: JsonFlag = False,
) -> None:
    """Inject a fault into one inventory worker; revert; TCP fault proxy."""
    if ctx.invoked_subcommand is not None:
        return
    if list_:
        from dynamo_ftctl.faults.inject import list_faults

        finish(ctx, list_faults(), json_flag=json_)
    sys.stdout.write(ctx.get_help() + "\n")
    raise typer.Exit(2)


@app.command("fault", hidden=True)
def fault_command(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    fault: Annotated[str, typer.Argument(help="Fault name (ftctl inject --list).")],
    worker: Annotated[str, typer.Option("--worker", "-w", help="Inventory worker name.",
                                        autocompletion=complete_worker)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the steps; do nothing.")]
    = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Confirm a destructive fault.")]
    = False,
    duration: Annotated[
        str | None, typer.Option("--duration", help="Revert after this long (30s, 2m).")
    ] = None,
    pid: Annotated[int | None, typer.Option("--pid", help="Signal this pid, not the "
                                            "inventory's pid file.", min=1)] = None,
    kmsg_path: Annotated[Path | None, typer.Option("--kmsg-path", help="Write Xid lines "
                                                   "here instead of the inventory's kmsg path.")]
    = None,
    gpuid: Annotated[int | None, typer.Option("--gpuid", help="GPU for dcgmi (default: the "
                                              "worker's gpus).", min=0)] = None,
    delay_ms: Annotated[float, typer.Option("--delay-ms", help="slow/thermal: per-token delay; "
                                            "net-latency: added latency.", min=0)] = 50.0,
    jitter_ms: Annotated[float, typer.Option("--jitter-ms", help="net-latency: ± jitter.",
                                             min=0)] = 0.0,
    after_tokens: Annotated[int, typer.Option("--after-tokens", help="disconnect: drop each "
                                              "stream after N tokens.", min=0)] = 20,
    rate_kbps: Annotated[float, typer.Option("--rate-kbps", help="net-bandwidth: KiB/s.",
                                             min=0.001)] = 64.0,
    rate: Annotated[float, typer.Option("--rate", help="overload: requests/s of the "
                                        "background load.", min=0.001)] = 200.0,
    concurrency: Annotated[int, typer.Option("--concurrency", help="overload: most requests "
                                             "in flight.", min=1)] = 256,
    audit_log: AuditOpt = None,
    state_dir: StateOpt = None,
    inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="Inventory "
                                                   "(default: the root -i).")] = None,
    json_: JsonFlag = False,
) -> None:
    """Inject FAULT into one worker."""
    from dynamo_ftctl.faults.inject import (
        InjectOptions,
        check_confirmation,
        plan_injection,
        run_injection,
    )
    from dynamo_ftctl.loadgen.config import parse_duration

    seconds = None if duration is None else parse_duration(duration, what="--duration")
    options = InjectOptions(
        pid=pid, kmsg_path=kmsg_path, gpuid=gpuid, delay_ms=delay_ms, jitter_ms=jitter_ms,
        after_tokens=after_tokens, rate_kbps=rate_kbps, duration_s=seconds, rate=rate,
        concurrency=concurrency, state_dir=state_dir,
    )
    plan = plan_injection(load_inventory_for(ctx, inventory), worker, fault, options)
    if dry_run:
        if json_mode(ctx, json_):
            finish(ctx, plan, json_flag=True)
        # Plain lines, never wrapped: a dry run shows each step exactly as it would run.
        sys.stdout.write("\n".join(plan.lines()) + "\n")
        raise typer.Exit(0)
    if check_confirmation(plan, yes=yes, interactive=sys.stdin.isatty()) and not typer.confirm(
        f"{plan.fault} takes {plan.worker} out of service. Inject?", err=True,
    ):
        raise typer.Exit(2)
    finish(ctx, run_injection(plan, audit_log=audit_log, state_dir=state_dir), json_flag=json_)


@app.command()
def revert(  # noqa: PLR0917 - typer passes every option positionally
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="Injection ids to revert.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Revert every pending injection.")]
    = False,
    list_: Annotated[bool, typer.Option("--list", help="List pending reverts only.")] = False,
    audit_log: AuditOpt = None,
    state_dir: StateOpt = None,
    json_: JsonFlag = False,
) -> None:
    """Apply pending reverts (left by duration-less or crashed injections).

    Example: ftctl inject revert --all
    """
    from dynamo_ftctl.faults.inject import pending_reverts, revert_pending

    if list_:
        pending = pending_reverts(state_dir)
        if json_mode(ctx, json_):
            finish(ctx, pending, json_flag=True)
        for rec in pending:
            sys.stdout.write(f"{rec['id']}  {rec['fault']} on {rec['worker']}\n")
        raise typer.Exit(0)
    result = revert_pending(ids or (), all_=all_, audit_log=audit_log, state_dir=state_dir)
    finish(ctx, result, json_flag=json_, code=1 if result.failed else 0)


@app.command()
def netproxy(
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to accept clients on.")],
    upstream: Annotated[str, typer.Option("--upstream", help="HOST:PORT to relay to.")],
    control: Annotated[str, typer.Option("--control", help="HOST:PORT of the HTTP control API.")]
    = "127.0.0.1:0",
    token_env: Annotated[str, typer.Option(
        "--token-env", help="Variable holding the control API's bearer token (POST/DELETE "
        "/toxics need it; unset: exit 2). The net injector reads the variable the worker's "
        "inject.netproxy_token_env names.")] = (
        "FTCTL_NETPROXY_TOKEN"),  # noqa: S107 - a variable's name, not a secret
) -> None:
    """Run the TCP fault proxy in the foreground (toxics via its control API).

    Prints one JSON line {listen, upstream, control} once it serves.
    Example: FTCTL_NETPROXY_TOKEN=secret ftctl inject netproxy --listen 127.0.0.1:9101
    --upstream 127.0.0.1:8101
    """
    import asyncio

    from dynamo_ftctl.auth import token_from_env
    from dynamo_ftctl.errors import InvalidInput
    from dynamo_ftctl.faults.netproxy import serve_netproxy
    from dynamo_ftctl.output import emit_line

    token = token_from_env(token_env)
    if token is None:
        msg = (f"${token_env} is not set: the control API needs a bearer token "
               "(--token-env names the variable)")
        raise InvalidInput(msg)
    asyncio.run(serve_netproxy(listen, upstream, control, emit_line, token=token,
                               token_env=token_env))
