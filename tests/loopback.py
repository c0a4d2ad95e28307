"""A scripted loopback HTTP server for client tests (`dynamo_ftctl.http1`, the load generator).
`until` (the asyncio tests' wait for a condition) lives in tests.waiting; imported here too."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from dynamo_ftctl.httpserver import Listener, listen_streams
from tests.waiting import until

__all__ = ["Handler", "Server", "until"]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """Hands each connection to `handler` (with its number, from 1); `async with` runs it."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.port = 0
        self._listener: Listener | None = None

    async def __aenter__(self) -> Server:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass  # the client hung up: what some tests do on purpose
            finally:
                writer.close()

        self._listener = await listen_streams(on_connect, "127.0.0.1", 0)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._listener is not None
        self._listener.close()
        await self._listener.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
