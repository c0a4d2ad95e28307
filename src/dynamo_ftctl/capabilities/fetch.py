"""How the probes reach a worker: an `http1.AsyncTransport`, and the package's default one.

Every probe is one `http1.Request` (its body capped at `MAX_PROBE_BYTES`) through
the transport it is given: the proxy passes its own `http1.Client`, tests a
`http1.MockTransport`, and the CLI gets `probe_client()`, an `http1.Client` of its
own. Every failure reaches the probes as an exception (http1's errors and
`TimeoutError` are `OSError`s) and leaves that probe's answer unknown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import Client

__all__ = ["MAX_PROBE_BYTES", "probe_client"]

# vLLM's /metrics is 50-300 KiB (histograms per model); 2 MiB leaves room and bounds
# what a hostile worker can make us hold.
MAX_PROBE_BYTES = 2 * 1024 * 1024


def probe_client() -> Client:
    """The default transport: a fresh `http1.Client` (close it when done)."""
    from dynamo_ftctl.http1 import Client

    return Client(user_agent="ftctl-probe")
