"""The `ftctl` console script: answers what it can before loading the CLI framework.

Probes and entrypoint scripts call `ftctl --version` to check the binary, and
Kubernetes exec probes run `ftctl canary --worker w3` every few seconds; neither
should pay for importing typer and click (about 40 ms). A one-shot canary probe
in its plain spelling runs without them (`cli/probe.py`); everything else, and
anything the fast path is unsure of, goes to the full CLI.
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
    if "canary" in args:
        from dynamo_ftctl.cli.probe import fast_canary

        rc = fast_canary(args)
        if rc is not None:
            return rc
    from dynamo_ftctl.cli.main import main as run

    return run(args)
