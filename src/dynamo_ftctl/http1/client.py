"""`Client`: the package's one HTTP client for async code, http:// and https:// alike.

A `Pool` behind two calls: `request` (the answer streamed, once its headers are
in) and `fetch` (one whole exchange within a deadline). https goes through the
same connections and parser, over asyncio's TLS. `fetch_blocking` is `fetch`
for blocking code (the etcd lock's threads, health waits, the fault injector's
admin calls): one exchange on a private event loop, no pool kept.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

from dynamo_ftctl.http1.pool import Pool
from dynamo_ftctl.http1.response import DEFAULT_LIMIT, Response

__all__ = ["AnyResponse", "Client", "fetch_blocking"]

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


def fetch_blocking(method: str, url: str, body: bytes = b"",
                   headers: dict[str, str] | None = None, *, timeout_s: float,
                   limit: int = DEFAULT_LIMIT,
                   ssl_context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """`Client.fetch` for blocking code: (status, body), on a private event loop.

    Raises what `fetch` raises (`HttpError`, `TimeoutError`). Called from a
    thread whose event loop is running (a blocking lock call in async code), it
    runs in a helper thread: a second loop cannot run on that thread.
    """

    async def exchange() -> tuple[int, bytes]:
        client = Client(ssl_context=ssl_context)
        try:
            return await client.fetch(method, url, body, headers, timeout_s=timeout_s,
                                      limit=limit)
        finally:
            await client.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(exchange())
    outcome: list[tuple[int, bytes] | BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(exchange()))
        except BaseException as exc:  # handed to the calling thread
            outcome.append(exc)

    helper = threading.Thread(target=run, name="ftctl-fetch-blocking", daemon=True)
    helper.start()
    helper.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result
