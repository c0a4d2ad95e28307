"""`python -m dynamo_ftctl` runs the `ftctl` command line, as the console script does."""

from dynamo_ftctl.cli.entry import console

__all__: list[str] = []

raise SystemExit(console())
