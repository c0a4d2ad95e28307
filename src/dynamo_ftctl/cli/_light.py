"""CLI glue without click or typer: shared by the full CLI and its fast paths.

`cli/_common.py` holds what needs typer (contexts, option types); this module
holds what a command needs around its library call and must stay importable
without the CLI framework: where the inventory is, and the one error boundary.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import ExitCode, FtctlError, MissingExtra

if TYPE_CHECKING:
    from dynamo_ftctl.inventory import Inventory

__all__ = ["DEFAULT_INVENTORY", "guarded", "inventory_path", "load_chosen_inventory",
           "optional_inventory"]

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
    return load_chosen_inventory(chosen)


def load_chosen_inventory(chosen: Path | None) -> Inventory:
    """The inventory at `inventory_path(chosen)`, validated. When none was named and
    ./ftctl.yaml does not exist, the error says how to name one (exit 2)."""
    path = inventory_path(chosen)
    named = chosen is not None or bool(os.environ.get("FTCTL_INVENTORY"))
    if not named and not path.exists():
        from dynamo_ftctl.errors import InventoryError

        msg = ("no such file, and no inventory named: give -i PATH (before or after the "
               "command) or set FTCTL_INVENTORY=PATH")
        raise InventoryError(msg, path=path)
    from dynamo_ftctl.inventory import load_inventory

    return load_inventory(path)


def guarded(call: Callable[[], int], *, debug: bool) -> int:
    """Run a command; the one place errors become an exit code and one line on stderr."""
    try:
        return call()
    except FtctlError as exc:
        return _report(exc, debug=debug)
    except ModuleNotFoundError as exc:
        # torch, numpy, pynvml, matplotlib load inside the functions that need them, so
        # a base install meets them only here: name the extra to install (exit 2).
        missing = MissingExtra.from_import_error(exc)
        if missing is None:
            raise
        return _report(missing, debug=debug)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # `ftctl ... | head`: the reader left. Silently exit 1, as click does for the
        # full CLI (the fast paths answer alike).
        _silence_stdout()
        return int(ExitCode.FAILED)
    except OSError as exc:
        if exc.filename is not None:
            # A file the library did not translate (a plot, a log): still one line
            # naming it, exit 1; the traceback with --debug.
            return _report(FtctlError(f"{exc.filename}: {exc.strerror or exc}"), debug=debug)
        if exc.errno not in _WRITE_REFUSED:
            raise
        _silence_stdout()
        return _report(FtctlError(f"cannot write output: {exc.strerror}"), debug=debug)


def _report(exc: FtctlError, *, debug: bool) -> int:
    """Say `exc` in one line on stderr (after the traceback being handled, with `debug`);
    its exit code. Called from an `except` block."""
    if debug:
        import traceback

        traceback.print_exc()
    from dynamo_ftctl.output import error

    error(str(exc))
    return int(exc.exit_code)


# The system refused a write (`> /dev/full`, a full or read-only disk): one line, exit 1.
_WRITE_REFUSED = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS))


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what a failed write left buffered is dropped at exit
    rather than failing again there (Python would print an error and exit 120)."""
    import contextlib

    with contextlib.suppress(OSError, ValueError, AttributeError):  # no real stdout
        from dynamo_ftctl.safefiles import open_device

        null = open_device(os.devnull)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
