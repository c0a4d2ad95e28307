"""The one-shot canary probe, reachable with and without the CLI framework.

A Kubernetes exec probe runs `ftctl canary --worker w3` every few seconds and
has 150 ms for everything, interpreter included; importing typer and click
costs about 40 ms of it. So the console script (`cli/entry.py`) first offers
the arguments to `fast_canary`: when they are exactly a one-shot probe spelled
with the options below, it runs `probe_once` directly; anything else (help, a
subcommand, `--watch`, an option it does not know, a value it would have to
judge) returns None and the full CLI parses the arguments, so the full CLI's
help and usage errors stay the only ones. The typer command (`cli/canary.py`)
calls the same `probe_once`. `FTCTL_NO_FAST_PATH=1` turns the fast path off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_ftctl.cli._light import guarded, optional_inventory

__all__ = ["FAST_FLAGS", "FAST_OPTIONS", "ROOT_FLAGS", "ROOT_OPTIONS", "fast_canary",
           "parse_one_shot", "probe_once"]

# The one-shot spellings the fast path accepts: option -> keyword of probe_once.
# Root options (before `canary`, or after it as in the full CLI) and the command's own
# (after it).
ROOT_OPTIONS = {"--inventory": "inventory", "-i": "inventory"}
ROOT_FLAGS = {"--json": "as_json", "--debug": "debug"}
FAST_OPTIONS = {"--worker": "workers", "-w": "workers", "--url": "url", "--set": "set_path",
                "--timeout": "timeout_s", "--state-file": "state_file"}
FAST_FLAGS = {"--all": "all_workers", "--no-state": "no_state", "--json": "as_json"}
_PATHS = {"inventory", "set_path", "state_file"}
_AFTER_OPTIONS = {**ROOT_OPTIONS, **FAST_OPTIONS}
_AFTER_FLAGS = {**ROOT_FLAGS, **FAST_FLAGS}


def probe_once(*, inventory: Path | None = None, workers: Sequence[str] = (),
               all_workers: bool = False, url: str | None = None, set_path: Path | None = None,
               timeout_s: float | None = None, state_file: Path | None = None,
               use_state: bool = True, as_json: bool = False) -> int:
    """Probe the chosen workers once, print the report, return its exit code (0/1/3).

    `inventory` is the root `-i` choice; without it, $FTCTL_INVENTORY or an
    existing ./ftctl.yaml is read, and `--url` needs no inventory at all.
    """
    from dynamo_ftctl.health.run import run_canary
    from dynamo_ftctl.output import emit

    loaded = optional_inventory(inventory, required=bool(workers) or all_workers)
    report = run_canary(loaded, workers=workers, all_workers=all_workers, url=url,
                        set_path=set_path, state_file=state_file, use_state=use_state,
                        timeout_s=timeout_s)
    emit(report, json_mode=as_json)
    return report.exit_code


def parse_one_shot(args: Sequence[str]) -> dict[str, Any] | None:
    """`probe_once` keywords (plus `debug`) for a plain one-shot probe; None for anything else."""
    found: dict[str, Any] = {"workers": []}
    options, flags = ROOT_OPTIONS, ROOT_FLAGS
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if options is ROOT_OPTIONS and arg == "canary":
            options, flags = _AFTER_OPTIONS, _AFTER_FLAGS
            continue
        if arg in flags:
            found[flags[arg]] = True
            continue
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name not in options:
            return None  # help, --watch, a subcommand, anything the full CLI must judge
        if not eq:
            if i == len(args) or args[i].startswith("-"):
                return None
            value = args[i]
            i += 1
        key = options[name]
        if key == "workers":
            found[key].append(value)
        elif key == "timeout_s":
            try:
                seconds = float(value)
            except ValueError:
                return None
            if not (math.isfinite(seconds) and seconds >= 0.001):  # the typer option's range
                return None
            found[key] = seconds
        else:
            found[key] = Path(value) if key in _PATHS else value
    if options is ROOT_OPTIONS:
        return None  # no `canary` at all
    found["use_state"] = not found.pop("no_state", False)
    return found


def fast_canary(args: Sequence[str]) -> int | None:
    """Run `args` as a one-shot probe without the CLI framework; None when it is not one."""
    if os.environ.get("FTCTL_NO_FAST_PATH"):
        return None
    keywords = parse_one_shot(args)
    if keywords is None:
        return None
    debug = bool(keywords.pop("debug", False))
    return guarded(lambda: probe_once(**keywords), debug=debug)
