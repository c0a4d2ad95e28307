"""ftctl: composable fault-tolerance utilities for LLM inference clusters.

The package root stays import-light: `ftctl --help` and `ftctl lock` import it
inside Kubernetes probes and engine entrypoints, so nothing heavy loads here.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
