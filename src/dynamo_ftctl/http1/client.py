"""`Client` for async code and `BlockingClient` beside it, http:// and https:// alike.

`Client` is a `Pool` behind three calls: `request` (the answer streamed, once its
headers are in), `fetch` (one whole exchange within a deadline) and
`handle_async_request` (the same as a `transport.AsyncTransport`). https goes
through the same connections and parser, over asyncio's TLS. `BlockingClient` is
a `transport.Transport` for blocking code (the etcd lock's threads, health waits,
the fault injector's admin calls): one exchange on a private event loop, no pool
kept; `fetch_blocking` is its one-call form.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from dynamo_ftctl.http1.pool import Pool
from dynamo_ftctl.http1.response import Response
from dynamo_ftctl.http1.transport import DEFAULT_LIMIT, Reply, Request

__all__ = ["BlockingClient", "Client", "fetch_blocking"]

T = TypeVar("T")

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

    async def handle_async_request(self, request: Request) -> Reply:
        """One whole exchange (`transport.AsyncTransport`): within `request.timeout_s`,
        the body at most `request.limit` bytes (`BodyTooLarge` past it)."""
        started = time.monotonic()
        async with asyncio.timeout(request.timeout_s):
            response = await self.request(request.method, request.url, request.body,
                                          request.headers or None)
            async with response:
                body = await response.read(request.limit)
        assert response.status is not None  # set before the headers are complete
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in response.headers.items()}
        first = None if response.body_at is None else response.body_at - started
        return Reply(response.status, body, headers, first)

    async def open_stream(self, request: Request) -> Response:
        """The answer to `request` once its headers are in (`transport.StreamingTransport`),
        within `request.timeout_s` (with `request.connect_timeout_s`: connected within
        that, the headers within `timeout_s` of the request going out); read it with
        `next_chunk`, `close` it when done."""
        if request.connect_timeout_s is not None:
            return await self.request(request.method, request.url, request.body,
                                      request.headers or None,
                                      connect_timeout_s=request.connect_timeout_s,
                                      head_timeout_s=request.timeout_s)
        async with asyncio.timeout(request.timeout_s):
            return await self.request(request.method, request.url, request.body,
                                      request.headers or None)

    async def close(self) -> None:
        """Hang up on every connection."""
        self.pool.close()


def _run_blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end on a private event loop; in a helper thread when this
    thread's loop is running (a second loop cannot run on it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(work))
        except BaseException as exc:  # handed to the calling thread
            outcome.append(exc)

    helper = threading.Thread(target=run, name="ftctl-fetch-blocking", daemon=True)
    helper.start()
    helper.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


class BlockingClient:
    """The blocking client (`transport.Transport`): each request one exchange on a
    private event loop, its connection closed after it.

    Raises what `Client.handle_async_request` raises (`HttpError`, `TimeoutError`).
    Called from a thread whose event loop is running (a blocking lock call in async
    code), the exchange runs in a helper thread.
    """

    def __init__(self, *, user_agent: str = "ftctl",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._user_agent = user_agent
        self._ssl_context = ssl_context

    def handle_request(self, request: Request) -> Reply:
        """The answer to `request` (`transport.Transport`)."""

        async def exchange() -> Reply:
            client = Client(user_agent=self._user_agent, ssl_context=self._ssl_context)
            try:
                return await client.handle_async_request(request)
            finally:
                await client.close()

        return _run_blocking(exchange())


def fetch_blocking(method: str, url: str, body: bytes = b"",
                   headers: dict[str, str] | None = None, *, timeout_s: float,
                   limit: int = DEFAULT_LIMIT,
                   ssl_context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """`Client.fetch` for blocking code: (status, body), through a `BlockingClient`.

    Raises what `fetch` raises (`HttpError`, `TimeoutError`).
    """
    request = Request(method, url, body, headers or {}, timeout_s, limit)
    reply = BlockingClient(ssl_context=ssl_context).handle_request(request)
    return reply.status, reply.body
