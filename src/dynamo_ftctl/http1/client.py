"""`Client`: the package's one HTTP client for async code, http:// and https:// alike.

A `Pool` behind two calls: `request` (the answer streamed, once its headers are
in) and `fetch` (one whole exchange within a deadline). https goes through the
same connections and parser, over asyncio's TLS.
"""

from __future__ import annotations

import asyncio
import ssl

from dynamo_ftctl.http1.pool import Pool
from dynamo_ftctl.http1.response import DEFAULT_LIMIT, Response

__all__ = ["AnyResponse", "Client"]

# What `Client.request` returns (once a `Response` or an aiohttp answer; kept for callers).
AnyResponse = Response


class Client:
    """Requests to http:// and https:// URLs through one `Pool`."""

    def __init__(self, *, user_agent: str = "ftctl",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.pool = Pool(user_agent=user_agent, ssl_context=ssl_context)

    async def request(self, method: str, url: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, *,
                      connect_timeout_s: float | None = None,
                      head_timeout_s: float | None = None) -> Response:
        """Send one request; its response once the headers are in (see `Pool.request`)."""
        return await self.pool.request(method, url, body, headers,
                                       connect_timeout_s=connect_timeout_s,
                                       head_timeout_s=head_timeout_s)

    async def fetch(self, method: str, url: str, body: bytes = b"",
                    headers: dict[str, str] | None = None, *, timeout_s: float,
                    limit: int = DEFAULT_LIMIT) -> tuple[int, bytes]:
        """One whole exchange within `timeout_s`: (status, body)."""
        async with asyncio.timeout(timeout_s):
            response = await self.request(method, url, body, headers)
            async with response:
                assert response.status is not None  # set before the headers are complete
                return response.status, await response.read(limit)

    async def close(self) -> None:
        """Hang up on every connection."""
        self.pool.close()
