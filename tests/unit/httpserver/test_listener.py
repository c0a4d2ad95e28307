"""The listener every server of the package accepts on: a stop never leaves an accepted
connection open, whenever clients arrive around it.

The property, over generated bursts: clients connect from another thread while the
server stops after a random number of them; once the stop has returned, every client
that got in reads an answer, an end or a reset within a deadline (none waits forever),
and the garbage collector finds no socket or transport left open. Python 3.11's
`loop.create_server` broke it: a connection accepted just before `Server.close()` was
never closed (CI: an unclosed transport of the fault proxy failed a vLLM test).
"""

from __future__ import annotations

import asyncio
import random
import socket

import pytest

from dynamo_ftctl.httpserver import Listener, Reply, Request, Server, start_server
from tests.bursts import burst_around_stop, loop_thread, no_unraisable


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(6))
def test_a_bare_listener_leaves_no_connection_open(seed: int) -> None:
    """Its protocols are closed by their owner; what it had not handed over is reset."""
    handed: list[asyncio.Transport] = []

    class Tracked(_Echo):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            assert isinstance(transport, asyncio.Transport)
            handed.append(transport)

    with no_unraisable() as found, loop_thread() as call:
        listener = call(Listener(Tracked).listen("127.0.0.1", 0))
        port = listener.sockets[0].getsockname()[1]

        async def stop() -> None:
            listener.close()
            await listener.wait_closed()
            for transport in handed:  # the owner's part
                transport.abort()

        got_in, stuck = burst_around_stop(port, lambda: call(stop()), random.Random(seed),
                                          [b"ping"])
        assert got_in
        assert not stuck, stuck
    assert not found, found


@pytest.mark.parametrize("seed", range(6))
def test_the_http_server_leaves_no_connection_open(seed: int) -> None:
    """`Server.shutdown` answers or ends every client that got in."""

    async def hello(_: Request) -> Reply:
        return Reply(200, b"hi", content_type="text/plain")

    with no_unraisable() as found, loop_thread() as call:
        server: Server = call(start_server(hello, "127.0.0.1", 0))
        port = int(server.address.rsplit(":", 1)[1])
        got_in, stuck = burst_around_stop(
            port, lambda: call(server.shutdown(1.0)), random.Random(seed),
            [b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"])
        assert got_in
        assert not stuck, stuck
    assert not found, found


def test_a_closed_listener_refuses_and_closes_twice_quietly() -> None:
    async def main() -> None:
        listener = await Listener(_Echo).listen("127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        listener.close()
        listener.close()
        assert listener.sockets == ()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)

    asyncio.run(main())


def test_a_port_in_use_is_an_os_error_and_binds_nothing() -> None:
    async def main() -> None:
        first = await Listener(_Echo).listen("127.0.0.1", 0)
        port = first.sockets[0].getsockname()[1]
        try:
            second = Listener(_Echo)
            with pytest.raises(OSError, match="in use"):
                await second.listen("127.0.0.1", port)
            assert second.sockets == ()
        finally:
            first.close()

    asyncio.run(main())


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_name_of_two_families_binds_both_on_one_port() -> None:
    """`localhost` with port 0: 127.0.0.1 and ::1, the same free port on each (as
    `loop.create_server` does); both answer."""

    async def main() -> None:
        listener = await Listener(_Echo).listen("localhost", 0)
        try:
            ports = {sock.getsockname()[1] for sock in listener.sockets}
            families = {sock.family for sock in listener.sockets}
            assert len(ports) == 1
            if len(families) < 2:
                pytest.skip("localhost names one family here")
            port = ports.pop()
            for host in ("127.0.0.1", "::1"):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(b"x")
                assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x"
                writer.close()
                await writer.wait_closed()
        finally:
            listener.close()

    asyncio.run(main())
