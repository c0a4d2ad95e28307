"""What /proc says of a process (Linux): its state, start time and command line.

The one reader for the places that must tell a live process from a zombie or a
reused pid without being its parent: the overload fault's revert and `ftctl sim
stop`. `PROC` is read at each call, so tests can point it at a fake tree.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PROC", "cmdline", "stat"]

PROC = Path("/proc")


def stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of `pid`, or None once it is gone.

    The command name may hold spaces and parentheses: the fields are taken after
    its last ")".
    """
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> list[bytes] | None:
    """The arguments of `pid` (empty while it exits), or None once it is gone."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
