"""CLI glue without click or typer: shared by the full CLI and its fast paths.

`cli/_common.py` holds what needs typer (contexts, option types); this module
holds what a command needs around its library call and must stay importable
without the CLI framework: where the inventory is, and the one error boundary.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import ExitCode, FtctlError

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Inventory

__all__ = ["DEFAULT_INVENTORY", "guarded", "inventory_path", "optional_inventory"]

DEFAULT_INVENTORY = Path("ftctl.yaml")


def inventory_path(chosen: Path | None) -> Path:
    """The inventory: `-i PATH` (`chosen`), then $FTCTL_INVENTORY, then ./ftctl.yaml."""
    if chosen is not None:
        return chosen
    env = os.environ.get("FTCTL_INVENTORY")
    return Path(env) if env else DEFAULT_INVENTORY


def optional_inventory(chosen: Path | None, *, required: bool) -> Inventory | None:
    """The inventory, for commands that also work without one (`canary --url`, `gpu`).

    `required`: always loaded from `inventory_path(chosen)`. Otherwise None when
    none was named (`-i`, $FTCTL_INVENTORY) and ./ftctl.yaml does not exist; a
    named file that does not exist is still loaded, so the error says so.
    """
    path = inventory_path(chosen)
    named = chosen is not None or bool(os.environ.get("FTCTL_INVENTORY"))
    if not (required or named or path.exists()):
        return None
    from dynamo_ftctl.inventory import load_inventory

    return load_inventory(path)


def guarded(call: Callable[[], int], *, debug: bool) -> int:
    """Run a command; the one place errors become an exit code and one line on stderr."""
    try:
        return call()
    except FtctlError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        from dynamo_ftctl.output import error

        error(str(exc))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # `ftctl ... | head`: the reader left; that is not our failure.
        sys.stderr.close()
        return 0
