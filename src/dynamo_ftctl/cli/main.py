"""Root of the `ftctl` command line.

The root command imports no command group: `COMMANDS` names each group's
module and one-line help, and a group's module is imported only when that
group runs (or its help is shown). `ftctl --help` therefore stays fast enough
for Kubernetes exec probes and engine entrypoints.

`main()` runs inside the one error boundary (`_light.guarded`): an `FtctlError`
becomes one red line on stderr and its exit code; a traceback appears only
with `--debug`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar

import click
import msgspec
import typer
import typer.core
from typer.core import TyperGroup

from dynamo_ftctl import __version__
from dynamo_ftctl.cli._common import GlobalOptions
from dynamo_ftctl.cli._light import guarded
from dynamo_ftctl.cli.completion import COMPLETE_VAR, answer_completion
from dynamo_ftctl.errors import ExitCode, InvalidInput

__all__ = ["COMMANDS", "CommandGroup", "app", "main", "unknown_command"]

# Every app here sets rich_markup_mode=None (plain click help), but typer 0.20 still
# escapes "[default: 0]" for rich markup whenever rich is installed, so plain help
# and the man pages showed "\[default: 0]", and it imported rich to do so.
typer.core.HAS_RICH = False

# name -> (module under dynamo_ftctl.cli, one-line help). Keep sorted by name.
COMMANDS: dict[str, tuple[str, str]] = {
    "canary": ("canary", "Canary probes with known answers (exit 0/1/3), health daemon, record."),
    "completion": ("completion", "Print the shell completion script for bash, zsh or fish."),
    "drill": ("drill", "Run a chaos drill: hypothesis, load + fault timeline, rollbacks, report."),
    "failover": ("failover", "Run an engine as a shadow: sleep, wait for the lock, wake, serve."),
    "gpu": ("gpu", "GPU status, Xid/ECC watchers (NVML or kernel log), fleet MTBF math."),
    "inject": ("inject", "Inject a fault into an inventory worker (safely), revert, net proxy."),
    "inventory": ("inventory", "Check, show and describe the cluster inventory."),
    "kv": ("kv", "Paged KV block copier: bandwidth vs a contiguous copy, chunk sweep."),
    "load": ("load", "Open-loop load with honest latencies, SLO sweeps, report compare."),
    "lock": ("lock", "Acquire, inspect and release the primary/shadow failover lock."),
    "migrate": ("migrate", "KV transfer vs re-prefill: cost plan, calibration, move a request."),
    "proxy": ("proxy", "Migrating OpenAI front door: streams survive worker failures; sheds load."),
    "sim": ("sim", "Reference engine (tiny deterministic torch LLM server) and local cluster."),
    "xid": ("xid", "Explain an NVIDIA Xid code, or list the catalog."),
}


_COMPLETION_PARAMS = frozenset({"install_completion", "show_completion"})

# The root options every command also takes after its own name (as kubectl and gh do):
# root parameter name -> field of GlobalOptions. --version and --help stay where they are.
_GLOBAL_PARAMS = {"inventory": "inventory", "json_": "json", "debug": "debug"}


class CommandGroup(TyperGroup):
    """A click group whose unknown subcommand is one line naming the nearest ones (exit 2),
    through the CLI's one error boundary rather than click's usage block."""

    def resolve_command(
        self, ctx: click.Context, args: list[str],
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and not ctx.resilient_parsing and not args[0].startswith("-"):
            names = self.list_commands(ctx)  # names only: a lazy group imports nothing here
            if args[0] not in names:
                raise InvalidInput(unknown_command(ctx.command_path, args[0], names))
        return super().resolve_command(ctx, args)


def unknown_command(path: str, name: str, known: list[str]) -> str:
    """The one line for an unknown command `name` of `path`: the nearest known names
    (difflib, at most 3), or where to find them."""
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if not close:
        return f"no such command {name!r} in {path}; {path} --help lists them"
    quoted = [repr(c) for c in close]
    options = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f"no such command {name!r} in {path} (did you mean {options}?)"


def _suggest_in_subgroups(command: click.Command) -> None:
    """Give every group typer built under `command` the same unknown-command line: typer
    makes them plain TyperGroups, whose click error is a usage block of four lines."""
    if not isinstance(command, click.Group):
        return
    if type(command) is TyperGroup:
        command.__class__ = CommandGroup  # adds one method, no state
    for sub in command.commands.values():
        _suggest_in_subgroups(sub)


class LazyGroup(CommandGroup):
    """A click group whose subcommands are imported on first use."""

    # How many commands ended by Ctrl-C (KeyboardInterrupt), which typer turns into a
    # silent exit 130 before main() could say so.
    interrupted: ClassVar[int] = 0

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            LazyGroup.interrupted += 1
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return super().get_command(ctx, cmd_name)
        module = importlib.import_module(f"dynamo_ftctl.cli.{spec[0]}")
        command = typer.main.get_command(module.app)
        # Completion is installed once, from the root; drop typer's per-app copies.
        command.params = [p for p in command.params if p.name not in _COMPLETION_PARAMS]
        command.name = cmd_name
        if not command.help:
            command.help = spec[1]
        command.short_help = spec[1]
        _inherit_global_options(command, [p for p in self.params if p.name in _GLOBAL_PARAMS])
        _suggest_in_subgroups(command)
        return command

    def format_commands(self, ctx: click.Context,  # noqa: ARG002 (click's signature)
        formatter: click.HelpFormatter) -> None:
        # Listing the groups must not import them: take the help from COMMANDS.
        rows = [(name, help_) for name, (_, help_) in sorted(COMMANDS.items())]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _inherit_global_options(command: click.Command, root_params: list[click.Parameter]) -> None:
    """Give `command` and every command under it the root's global options, hidden.

    Click parses them where they appear, so `--` and option values keep their meaning
    (`ftctl lock acquire -- cmd -i x` passes `-i x` to cmd, as does a command that stops
    at its first argument). A command that defines a spelling itself keeps its own (its
    `--json` and `-i` mean the same as the root's); the others are added.
    """
    taken = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for root_param in root_params:
        free = [opt for opt in root_param.opts if opt not in taken]
        if not free or not isinstance(root_param, click.Option):
            continue
        command.params.append(click.Option(
            [str(root_param.name), *free], type=None if root_param.is_flag else root_param.type,
            is_flag=root_param.is_flag, hidden=True, expose_value=False,
            callback=_record_global, help=root_param.help))
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _inherit_global_options(sub, root_params)


def _record_global(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """A global option given after a subcommand: it overrides the one before it."""
    if value is None or value is False:
        return
    if isinstance(value, str):  # click's path type gives text; typer converts only its own
        value = Path(value)
    root = ctx.find_root()
    current = root.obj if isinstance(root.obj, GlobalOptions) else GlobalOptions()
    root.obj = msgspec.structs.replace(current, **{_GLOBAL_PARAMS[str(param.name)]: value})


app = typer.Typer(
    cls=LazyGroup,
    name="ftctl",
    help=(
        "Fault-tolerance utilities for LLM inference clusters: canary probes, failover "
        "locks, a migrating proxy, KV transfer, fault injection, chaos drills and load.\n\n"
        "Exit codes: 0 ok/healthy, 1 check failed, 2 bad usage or input, "
        "3 unreachable or timed out, 4 lock not acquired in time, 5 lock lost while held, "
        "130 interrupted.\n\n"
        "-i/--inventory, --json and --debug may also follow any subcommand "
        "(`ftctl canary --worker w3 -i inv.yaml`); after `--` nothing is an option.\n\n"
        "Shell completion (commands, options, worker and fault names from the inventory): "
        "ftctl completion bash|zsh|fish."
    ),
    rich_markup_mode=None,
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"ftctl {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    inventory: Annotated[
        Path | None,
        typer.Option(
            "--inventory", "-i", envvar="FTCTL_INVENTORY", show_envvar=True,
            help="Cluster inventory YAML (default: $FTCTL_INVENTORY, then ./ftctl.yaml).",
        ),
    ] = None,
    json_: Annotated[
        bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else."),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[  # noqa: ARG001 (handled by its eager callback)
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Fault-tolerance utilities for LLM inference clusters."""
    ctx.obj = GlobalOptions(inventory=inventory, json=json_, debug=debug)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (errors become codes in `guarded`)."""
    args = sys.argv[1:] if argv is None else argv
    command = typer.main.get_command(app)
    instruction = os.environ.get(COMPLETE_VAR)
    if instruction:
        return answer_completion(command, instruction)

    def run() -> int:
        interrupted = LazyGroup.interrupted
        try:
            rc: Any = command.main(args=args, prog_name="ftctl", standalone_mode=False)
        except click.exceptions.Abort:
            raise KeyboardInterrupt from None
        except click.ClickException as exc:
            exc.show()
            return int(ExitCode.USAGE) if isinstance(exc, click.UsageError) else exc.exit_code
        if LazyGroup.interrupted > interrupted:
            # typer turns Ctrl-C into a silent exit 130: say it, as `guarded` does.
            raise KeyboardInterrupt
        return rc if isinstance(rc, int) else 0

    # Before any `--`: what follows belongs to a command ftctl runs.
    options = args[: args.index("--")] if "--" in args else args
    return guarded(run, debug="--debug" in options)


if __name__ == "__main__":
    raise SystemExit(main())
