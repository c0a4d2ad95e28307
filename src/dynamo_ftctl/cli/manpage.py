"""Generate roff man pages from the click command tree: `python -m dynamo_ftctl.cli.manpage man`.

One page for the root (`ftctl.1`) and one per command group (`ftctl-<group>.1`),
deterministic (no dates) so that a test can tell when `man/` is stale.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click
import typer
from click import Group

from dynamo_ftctl import __version__
from dynamo_ftctl.cli.main import COMMANDS, app

__all__ = ["render_pages", "write_pages"]

_EXIT_STATUS = (
    (0, "success; the target is healthy"),
    (1, "a check ran and failed (unhealthy, mismatch, drill hypothesis broken), or the "
        "output could not be written (a full disk, permission denied: one line naming the "
        "file; a closed pipe, silently)"),
    (2, "bad usage or invalid input (flags, inventory, scenario, canary set), or an output "
        "path ftctl will not replace (a device, FIFO, socket, directory, or a symbolic link "
        "out of its directory)"),
    (3, "target unreachable or timed out"),
    (4, "lock not acquired within --timeout"),
    (5, "a held lock was lost (etcd lease lost, lock file deleted or replaced)"),
    (130, "interrupted"),
)


def _esc(text: str) -> str:
    """Escape text for roff: backslashes, and leading dots/quotes that roff reads as requests."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    lines = []
    for line in out.splitlines():
        stripped = line.lstrip()
        lines.append(f"\\&{line}" if stripped[:1] in (".", "'") else line)
    return "\n".join(lines)


def _paragraphs(text: str) -> str:
    blocks = [b.strip() for b in text.strip().split("\n\n") if b.strip()]
    return "\n.PP\n".join(_esc(" ".join(line.strip() for line in b.splitlines())) for b in blocks)


def _param_rows(command: click.Command, ctx: click.Context) -> Iterator[tuple[str, str]]:
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        yield record[0], record[1]


def _options_section(command: click.Command, ctx: click.Context) -> str:
    rows = list(_param_rows(command, ctx))
    if not rows:
        return ""
    out = []
    for names, help_ in rows:
        out.append(f".TP\n.B {_esc(names)}\n{_esc(help_) or ' '}")
    return "\n".join(out)


def _usage(command: click.Command, ctx: click.Context) -> str:
    pieces = command.collect_usage_pieces(ctx)
    return " ".join(pieces)


def _walk(
    command: click.Command, ctx: click.Context, path: list[str],
) -> Iterator[tuple[list[str], click.Command, click.Context]]:
    yield path, command, ctx
    if isinstance(command, Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            sub_ctx = click.Context(sub, info_name=name, parent=ctx)
            yield from _walk(sub, sub_ctx, [*path, name])


def _page(title: str, summary: str, body: list[str]) -> str:
    head = [
        f'.TH {title.upper()} 1 "" "ftctl {__version__}" "ftctl manual"',
        ".SH NAME",
        f"{_esc(title)} \\- {_esc(summary)}",
    ]
    return "\n".join([*head, *body]) + "\n"


def _exit_status() -> list[str]:
    out = [".SH EXIT STATUS"]
    for code, meaning in _EXIT_STATUS:
        out.append(f".TP\n.B {code}\n{_esc(meaning)}")
    return out


def _group_page(name: str, command: click.Command, parent: click.Context) -> str:
    ctx = click.Context(command, info_name=name, parent=parent)
    body: list[str] = []
    entries = list(_walk(command, ctx, [name]))
    body.append(".SH SYNOPSIS")
    for path, sub, sub_ctx in entries:
        if isinstance(sub, Group) and path != [name]:
            continue
        body.append(f".B ftctl {' '.join(path)}\n{_esc(_usage(sub, sub_ctx))}\n.br")
    body.append(".SH DESCRIPTION")
    body.append(_paragraphs(command.help or COMMANDS[name][1]))
    options = _options_section(command, ctx)
    if options:
        body.append(".SH OPTIONS")
        body.append(options)
    subcommands = [(p, s, c) for p, s, c in entries if p != [name]]
    if subcommands:
        body.append(".SH COMMANDS")
        for path, sub, sub_ctx in subcommands:
            body.append(f'.SS "ftctl {" ".join(path)}"')
            if sub.help:
                body.append(_paragraphs(sub.help))
            sub_options = _options_section(sub, sub_ctx)
            if sub_options:
                body.append(sub_options)
    body.extend(_exit_status())
    body.append(".SH SEE ALSO\n.BR ftctl (1)")
    return _page(f"ftctl-{name}", COMMANDS[name][1], body)


def _root_page(root: click.Command, ctx: click.Context) -> str:
    body = [".SH SYNOPSIS", f".B ftctl\n{_esc(_usage(root, ctx))}"]
    body.append(".SH DESCRIPTION")
    body.append(_paragraphs(root.help or ""))
    body.append(".SH OPTIONS")
    body.append(_options_section(root, ctx))
    body.append(".SH COMMANDS")
    for name, (_, help_) in sorted(COMMANDS.items()):
        body.append(f".TP\n.BR ftctl\\-{_esc(name)} (1)\n{_esc(help_)}")
    body.append(".SH ENVIRONMENT")
    body.append(".TP\n.B FTCTL_INVENTORY\nDefault inventory path when -i is not given.")
    body.append(".TP\n.B FTCTL_ADMIN_TOKEN\nDefault variable holding worker admin tokens "
                "(tokens never travel in flags): ftctl sim's /admin/*, /sleep and /wake_up, "
                "and the proxy's POST /busy_threshold.")
    body.append(".TP\n.B FTCTL_DAEMON_TOKEN\nDefault variable holding the canary daemon's "
                "bearer token: POST /report needs it; the proxy and gpu --report send it.")
    body.append(".TP\n.B FTCTL_NETPROXY_TOKEN\nDefault variable holding the TCP fault "
                "proxy's control token (POST/DELETE /toxics).")
    body.append(".TP\n.B NO_COLOR\nDisable colour on stderr.")
    body.extend(_exit_status())
    see = ", ".join(f".BR ftctl\\-{n} (1)" for n in sorted(COMMANDS))
    body.append(".SH SEE ALSO\n" + "\n".join(see.split(", ")))
    return _page("ftctl", "fault-tolerance utilities for LLM inference clusters", body)


def render_pages() -> dict[str, str]:
    """Every man page as {file name: roff text}."""
    root = typer.main.get_command(app)
    ctx = click.Context(root, info_name="ftctl")
    pages = {"ftctl.1": _root_page(root, ctx)}
    assert isinstance(root, Group)
    for name in sorted(COMMANDS):
        command = root.get_command(ctx, name)
        if command is not None:
            pages[f"ftctl-{name}.1"] = _group_page(name, command, ctx)
    return pages


def write_pages(folder: Path) -> list[Path]:
    """Write every page into `folder`, removing pages of commands that no longer exist."""
    from dynamo_ftctl.output import write_atomic

    folder.mkdir(parents=True, exist_ok=True)
    pages = render_pages()
    for stale in folder.glob("ftctl*.1"):
        if stale.name not in pages:
            stale.unlink()
    written = []
    for file_name, text in pages.items():
        target = folder / file_name
        write_atomic(target, text)
        written.append(target)
    return written


if __name__ == "__main__":
    for page in write_pages(Path(sys.argv[1] if len(sys.argv) > 1 else "man")):
        sys.stdout.write(f"{page}\n")
