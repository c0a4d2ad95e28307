"""`ftctl lock acquire` in its plain spellings, without the CLI framework.

An engine entrypoint runs `ftctl lock acquire --path P -- CMD` (or `--fd N`) and its
handoff should cost what flock(1)'s does. Loading typer, click and the command tree
costs ~40 ms at start-up, and, worse, a process that large takes milliseconds longer to
exec CMD (the kernel tears down its address space inside execve; docs/benchmarks.md,
"lock.py", has the exec times). This path takes the flock backend with the lock file named by
`--path` or $FAILOVER_LOCK_PATH; anything else (`--help`, `--backend`, the inventory,
an option it does not know or a value it cannot read) goes to the full CLI, which
says what is wrong.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from dynamo_ftctl.cli._light import guarded

__all__ = ["fast_lock_acquire", "parse_acquire"]

# Options of `lock acquire` this path takes, and the keyword each fills.
_OPTIONS = {"--path": "path", "-p": "path", "--engine-id": "engine_id", "--timeout": "timeout",
            "-t": "timeout", "--watch-interval": "watch_interval", "--fd": "fd"}
_FLAGS = {"--json": "json"}
_INTS = frozenset(("engine_id", "fd"))


def _value(key: str, raw: str) -> Any:
    """The option's value, or None when the full CLI must judge it."""
    try:
        value: Any = int(raw) if key in _INTS else raw if key == "path" else float(raw)
    except ValueError:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def parse_acquire(args: Sequence[str]) -> dict[str, Any] | None:
    """The options and command of `lock acquire ARGS` (after `lock acquire`) for this
    path; None when the full CLI must run it."""
    found: dict[str, Any] = {"command": []}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--" or not arg.startswith("-"):  # the command (no interspersed options)
            found["command"] = list(args[i:] if arg == "--" else args[i - 1:])
            break
        if arg in _FLAGS:
            found[_FLAGS[arg]] = True
            continue
        name, eq, raw = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name not in _OPTIONS:
            return None
        if not eq:
            if i == len(args):
                return None
            raw = args[i]
            i += 1
        value = _value(_OPTIONS[name], raw)
        if value is None:
            return None
        found[_OPTIONS[name]] = value
    command, fd = found["command"], found.get("fd")
    if (fd is None) == (not command):  # both or neither: the full CLI's message
        return None
    if fd is not None and "watch_interval" in found:
        return None
    if fd is None and "path" not in found and not os.environ.get("FAILOVER_LOCK_PATH"):
        return None  # the lock file comes from the inventory
    return found


def fast_lock_acquire(args: Sequence[str]) -> int | None:
    """Run `ftctl ARGS` when it is a plain `lock acquire`; None when it is not one."""
    if os.environ.get("FTCTL_NO_FAST_PATH") or list(args[:2]) != ["lock", "acquire"]:
        return None
    if os.environ.get("FTCTL_LOCK_BACKEND", "flock") != "flock":
        return None
    found = parse_acquire(args[2:])
    if found is None:
        return None
    return guarded(lambda: _acquire(found), debug=False)


def _acquire(found: dict[str, Any]) -> int:
    from dynamo_ftctl.lock.settings import engine_id_from_env

    engine_id = engine_id_from_env(found.get("engine_id"))
    if found.get("fd") is not None:
        from dynamo_ftctl.lock.flock import flock_descriptor
        from dynamo_ftctl.output import emit  # loaded before the wait, not after the grant

        lease = flock_descriptor(found["fd"], engine_id, timeout=found.get("timeout"))
        emit(lease, json_mode=bool(found.get("json")))
        return 0
    from pathlib import Path

    from dynamo_ftctl.lock.holder import hold_for_command
    from dynamo_ftctl.lock.settings import resolve_lock_settings

    path = found.get("path")
    settings = resolve_lock_settings(
        backend="flock", engine_id=engine_id, path=None if path is None else Path(path),
        watch_interval_s=found.get("watch_interval"))
    return hold_for_command(settings, found["command"], found.get("timeout"))
