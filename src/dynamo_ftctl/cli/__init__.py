"""The `ftctl` command line: one typer module per command group, loaded lazily.

Nothing in the library imports this package.
"""

__all__: list[str] = []
