"""The `ftctl` console script: answers `--version` before loading the CLI framework.

Probes and entrypoint scripts call `ftctl --version` to check the binary; it
must not pay for importing typer (about 100 ms here).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ftctl` script and `python -m dynamo_ftctl`."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        from dynamo_ftctl import __version__

        sys.stdout.write(f"ftctl {__version__}\n")
        return 0
    from dynamo_ftctl.cli.main import main as run

    return run(args)
