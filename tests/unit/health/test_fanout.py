"""The daemon's fan-out transport on keep-alive connections: reuse, the keep-alive race,
and hanging up on a cancelled probe (the one-shot contract is in test_transport.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dynamo_ftctl.health.fanout import ClientTransport
from dynamo_ftctl.health.transport import TransportError, apost_json

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

# What the server does with the n-th request (0-based) of a connection: its answer,
# or None to hang up without one, or "silent" to never answer.
Plan = Callable[[int], bytes | str | None]


class _Server(asyncio.Protocol):
    """Counts connections and requests; answers each request as `plan` says."""

    def __init__(self, plan: Plan, log: list[_Server]) -> None:
        self.plan = plan
        self.requests = 0
        self.closed = asyncio.get_running_loop().create_future()
        log.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not data.endswith(b"}"):  # the whole request: `{...}` ends every test body
            return
        what = self.plan(self.requests)
        self.requests += 1
        if what is None:
            self.transport.close()
        elif isinstance(what, bytes):
            self.transport.write(what)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _run(plan: Plan, body: Callable[[str, list[_Server]], Awaitable[None]],
         protocol: type[_Server] = _Server) -> None:
    """Serve `plan` on a loopback port and run `body(url, connections)` within 10 s."""
    async def main() -> None:
        log: list[_Server] = []
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: protocol(plan, log), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await asyncio.wait_for(body(f"http://127.0.0.1:{port}/w1/v1/completions", log), 10)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_kept_connection_carries_the_next_requests() -> None:
    """Three probes one after another to one worker: one connection, three answers."""
    async def body(url: str, log: list[_Server]) -> None:
        transport = ClientTransport()
        try:
            for _ in range(3):
                reply = await apost_json(transport, url, b"{}", timeout_s=5)
                assert (reply.status, reply.body) == (200, b"{}")
        finally:
            await transport.close()
        assert [s.requests for s in log] == [3]

    _run(lambda _: OK, body)


def test_a_kept_connection_closed_as_it_is_reused_is_retried_once_on_a_new_one() -> None:
    """The server times the idle connection out just as the next request arrives: the
    probe is answered on a new connection, not failed as a reset."""
    async def body(url: str, log: list[_Server]) -> None:
        transport = ClientTransport()
        try:
            await apost_json(transport, url, b"{}", timeout_s=5)
            reply = await apost_json(transport, url, b"{}", timeout_s=5)
        finally:
            await transport.close()
        assert reply.status == 200
        assert [s.requests for s in log] == [2, 1]

    _run(lambda n: OK if n == 0 else None, body)


def test_a_fresh_connection_closed_before_answering_is_a_reset_not_retried() -> None:
    """Only a reused connection gets the second chance: a new one that closes is a verdict."""
    async def body(url: str, log: list[_Server]) -> None:
        transport = ClientTransport()
        try:
            with pytest.raises(TransportError) as err:
                await apost_json(transport, url, b"{}", timeout_s=5)
        finally:
            await transport.close()
        assert err.value.kind == "reset"
        assert len(log) == 1

    _run(lambda _: None, body)


def test_a_cancelled_probe_hangs_up_its_connection() -> None:
    """Cancelling a probe in flight (the daemon stopping) closes its connection: it is
    never lent to another request with an answer still owed on it."""
    async def body(url: str, log: list[_Server]) -> None:
        transport = ClientTransport()
        try:
            task = asyncio.ensure_future(apost_json(transport, url, b"{}", timeout_s=30))
            while not log or not log[0].requests:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(log[0].closed, 5)
            port = int(url.split(":")[2].split("/", maxsplit=1)[0])
            assert transport.session.pool.take_idle(("http", "127.0.0.1", port)) is None
        finally:
            await transport.close()

    _run(lambda _: "silent", body)


def test_extra_headers_travel_with_the_json_content_type() -> None:
    """Headers a caller passes are sent beside Content-Type (not cached per URL)."""
    seen: list[bytes] = []

    class Recording(_Server):
        def data_received(self, data: bytes) -> None:
            seen.append(data)
            super().data_received(data)

    async def body(url: str, log: list[_Server]) -> None:
        del log
        transport = ClientTransport()
        try:
            await apost_json(transport, url, b"{}", timeout_s=5,
                                      headers={"Authorization": "Bearer t"})
            await apost_json(transport, url, b"{}", timeout_s=5)
        finally:
            await transport.close()

    _run(lambda _: OK, body, Recording)
    first, second = seen
    assert b"Content-Type: application/json\r\n" in first
    assert b"Authorization: Bearer t\r\n" in first
    assert b"Content-Type: application/json\r\n" in second
    assert b"Authorization" not in second
    assert first.startswith(b"POST /w1/v1/completions HTTP/1.1\r\n")
