"""`ftctl completion`: shell completion scripts, and the answers they ask `ftctl` for.

The scripts are click's (bash 4.4+, zsh, fish): on each TAB the shell runs `ftctl`
with `_FTCTL_COMPLETE=<shell>_complete` and the words typed so far in its environment
(`COMP_WORDS`/`COMP_CWORD` for bash). `cli/main.py` answers that before typer sees it,
through `answer_completion` and click's own shell classes: typer registers classes
of its own, with another protocol, whenever it converts a group's app.

Worker and fault names come from the inventory the line being completed names
(`-i` before or after the subcommand, else $FTCTL_INVENTORY, else ./ftctl.yaml);
an inventory that cannot be read completes nothing. Completing imports no more
than the command line's own modules and the inventory loader (no torch, no httpx).
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import click
import typer
from click.shell_completion import (
    BashComplete,
    CompletionItem,
    FishComplete,
    ShellComplete,
    ZshComplete,
    _resolve_context,
    _resolve_incomplete,
)

from dynamo_ftctl.cli._common import global_options
from dynamo_ftctl.cli._light import inventory_path
from dynamo_ftctl.errors import FtctlError

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Inventory

__all__ = ["COMPLETE_VAR", "answer_completion", "complete_fault", "complete_worker",
           "complete_worker_list", "fault_items"]

# The variable click derives from the program name; the scripts set it.
COMPLETE_VAR = "_FTCTL_COMPLETE"

class _PathsAsFiles(ShellComplete):
    """click's answer, except that a path parameter asks the shell to complete files.

    typer's path type answers nothing, since typer's own scripts fall back to file names
    whenever the answer is empty; click's scripts complete files only when told `file`.
    """

    def get_completions(self, args: list[str], incomplete: str) -> list[CompletionItem]:
        ctx = _resolve_context(self.cli, self.ctx_args, self.prog_name, args)
        obj, incomplete = _resolve_incomplete(ctx, args, incomplete)
        items = obj.shell_complete(ctx, incomplete)
        if not items and isinstance(obj, click.Parameter) and isinstance(obj.type, click.Path):
            kind = "dir" if obj.type.dir_okay and not obj.type.file_okay else "file"
            return [CompletionItem(incomplete, type=kind)]
        return items


class _Bash(_PathsAsFiles, BashComplete):
    pass


class _Zsh(_PathsAsFiles, ZshComplete):
    pass


class _Fish(_PathsAsFiles, FishComplete):
    pass


_SHELLS: dict[str, type[ShellComplete]] = {"bash": _Bash, "zsh": _Zsh, "fish": _Fish}


class Shell(StrEnum):
    """The shells `ftctl completion` writes a script for."""

    bash = "bash"
    zsh = "zsh"
    fish = "fish"


app = typer.Typer(rich_markup_mode=None, add_completion=False)


@app.command()
def completion(
    ctx: typer.Context,
    shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the completion script for SHELL on stdout.

    It completes commands, options, and worker and fault names from the inventory
    (-i on the line being completed, else $FTCTL_INVENTORY, else ./ftctl.yaml).

    bash 4.4+, in ~/.bashrc: eval "$(ftctl completion bash)"

    zsh, in ~/.zshrc after compinit: eval "$(ftctl completion zsh)"

    fish: ftctl completion fish > ~/.config/fish/completions/ftctl.fish
    """
    answer = _SHELLS[shell.value](ctx.find_root().command, {}, "ftctl", COMPLETE_VAR)
    click.echo(answer.source())


def answer_completion(command: click.Command, instruction: str) -> int:
    """Answer a completion request (`$_FTCTL_COMPLETE`, e.g. `bash_complete`); the exit code."""
    shell, _, action = instruction.partition("_")
    shell_class = _SHELLS.get(shell)
    if shell_class is None or action not in {"source", "complete"}:
        click.echo(f"error: {COMPLETE_VAR}={instruction}: expected bash, zsh or fish, then "
                   "_source or _complete", err=True)
        return 2
    answer = shell_class(command, {}, "ftctl", COMPLETE_VAR)
    click.echo(answer.source() if action == "source" else answer.complete())
    return 0


def _line_inventory(ctx: click.Context) -> Inventory | None:
    """The inventory the line being completed names; None when it cannot be read."""
    chosen: Path | None = None
    level: click.Context | None = ctx
    while level is not None and level.parent is not None and chosen is None:
        chosen = _as_path(level.params.get("inventory"))  # its own -i (`inject`, `load`)
        level = level.parent
    root = ctx.find_root()
    # While completing, the root's callback does not run: its -i is still in its params;
    # a -i after the subcommand is in the root's GlobalOptions, and wins, as it does when run.
    chosen = chosen or global_options(ctx).inventory or _as_path(root.params.get("inventory"))
    from dynamo_ftctl.inventory import load_inventory

    try:
        return load_inventory(inventory_path(chosen))
    except (FtctlError, OSError, ValueError):
        return None  # a TAB prints no error: nothing to offer


def _as_path(value: object) -> Path | None:
    """A parsed -i value (click gives text; typer makes it a Path only when it runs)."""
    return Path(value) if isinstance(value, str | Path) and str(value) else None


def complete_worker(ctx: click.Context, incomplete: str) -> list[tuple[str, str]]:
    """Inventory worker names starting with `incomplete`, each with its URL as help."""
    inventory = _line_inventory(ctx)
    if inventory is None:
        return []
    return [(w.name, w.url) for w in inventory.workers if w.name.startswith(incomplete)]


def complete_worker_list(ctx: click.Context, incomplete: str) -> list[str]:
    """A comma-separated list of workers (`load --workers w1,w2`): the last name completed."""
    done, comma, last = incomplete.rpartition(",")
    named = set(done.split(",")) if comma else set()
    return [f"{done}{comma}{name}" for name, _ in complete_worker(ctx, last)
            if name not in named]


def complete_fault(ctx: click.Context, incomplete: str) -> list[tuple[str, str]]:
    """Faults the inventory allows on some worker (a protected worker allows none)."""
    inventory = _line_inventory(ctx)
    if inventory is None:
        return []
    allowed = sorted({fault for w in inventory.workers if not w.protected
                      for fault in w.faults})
    from dynamo_ftctl.faultnames import FAULTS

    return [(name, FAULTS[name].summary if name in FAULTS else "NVIDIA Xid " + name[3:])
            for name in allowed if name.startswith(incomplete)]


def fault_items(ctx: click.Context, incomplete: str) -> list[CompletionItem]:
    """`complete_fault` as click's completion items (for a group's own completion)."""
    return [CompletionItem(name, help=help_) for name, help_ in complete_fault(ctx, incomplete)]
