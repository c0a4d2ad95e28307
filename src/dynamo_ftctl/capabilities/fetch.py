"""How the probes reach a worker: one `Fetch` callable, and the package's default one.

`Fetch` is `async (method, url, body, headers, timeout_s) -> (status, body)`,
optionally with a third item, the response headers (the `Server` header is read
from it). The proxy passes its own `http1.Client` through `fetch_through`,
tests pass a fake, and the CLI gets `ClientFetch`: an `http1.Client` of its
own that reads at most `MAX_PROBE_BYTES` of a body. Every failure reaches the
probes as an `OSError` (http1's errors and `TimeoutError` are ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from dynamo_ftctl.http1 import Client

__all__ = ["MAX_PROBE_BYTES", "ClientFetch", "Fetch", "FetchResult", "WholeBodyClient",
           "fetch_through"]

# (status, body) or (status, body, headers): what one exchange through a `Fetch` gives.
FetchResult = tuple[int, bytes] | tuple[int, bytes, Mapping[str, str]]
Fetch = Callable[[str, str, bytes, Mapping[str, str] | None, float], Awaitable[FetchResult]]

# vLLM's /metrics is 50-300 KiB (histograms per model); 2 MiB leaves room and bounds
# what a hostile worker can make us hold.
MAX_PROBE_BYTES = 2 * 1024 * 1024


class ClientFetch:
    """The default `Fetch`: one `http1.Client`, bodies read to at most `max_bytes`."""

    def __init__(self, *, max_bytes: int = MAX_PROBE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._client = Client(user_agent="ftctl-probe")

    async def __call__(self, method: str, url: str, body: bytes,
                       headers: Mapping[str, str] | None, timeout_s: float) -> FetchResult:
        """One exchange within `timeout_s`; OSError for no answer or a body over the cap."""
        async with asyncio.timeout(timeout_s):
            response = await self._client.request(method, url, body, dict(headers or {}))
            async with response:
                data = await response.read(self.max_bytes)
                assert response.status is not None  # set once the headers are in
                server = response.header("server")
                return response.status, data, ({"Server": server} if server else {})

    async def aclose(self) -> None:
        """Hang up on every connection."""
        await self._client.close()

    async def __aenter__(self) -> ClientFetch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class WholeBodyClient(Protocol):
    """A client with `dynamo_ftctl.http1.Client.fetch`'s shape (the proxy's own)."""

    async def fetch(self, method: str, url: str, body: bytes = b"",
                    headers: dict[str, str] | None = None, *, timeout_s: float,
                    limit: int = ...) -> tuple[int, bytes]:
        """One whole exchange within `timeout_s`: (status, body), at most `limit` bytes."""
        ...


def fetch_through(client: WholeBodyClient, *, max_bytes: int = MAX_PROBE_BYTES) -> Fetch:
    """A `Fetch` over an existing client (the proxy's `http1.Client`), reads capped."""

    async def fetch(method: str, url: str, body: bytes, headers: Mapping[str, str] | None,
                    timeout_s: float) -> FetchResult:
        return await client.fetch(method, url, body, dict(headers or {}), timeout_s=timeout_s,
                                  limit=max_bytes)

    return fetch
