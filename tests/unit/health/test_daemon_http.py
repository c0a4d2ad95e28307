"""The canary daemon's API on the package's HTTP server, over a loopback socket:
the server's hardening (head size, slow clients) covers the daemon."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.health.daemon import HealthDaemon, WatchedWorker, serve_api, split_listen
from dynamo_ftctl.health.probe import ProbeTarget
from dynamo_ftctl.httpserver import Server
from dynamo_ftctl.inventory.canary import CanaryConfig

from .fakes import SET, AsyncFakeWorkers

TOKEN = "daemon-s3cret"


def _daemon() -> HealthDaemon:
    clock = FakeClock()
    worker = WatchedWorker(ProbeTarget("hx0", "http://hx0", "m"), "node-a", (0,))
    return HealthDaemon([worker], SET, CanaryConfig(), clock=clock,
                        transport=AsyncFakeWorkers(clock), metrics=False)


async def _exchange(server: Server, data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send `data` on a new connection; everything the server sends until it hangs up."""
    port = int(server.address.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait_s)
    finally:
        writer.close()


def test_health_and_report_answer_over_a_socket() -> None:
    """GET /health is 200 JSON; POST /report without the token is 401 on the wire."""
    async def go() -> tuple[bytes, bytes]:
        server = await serve_api(_daemon(), "127.0.0.1:0", token=TOKEN)
        try:
            health = await _exchange(server, b"GET /health HTTP/1.1\r\nHost: d\r\n"
                                             b"Connection: close\r\n\r\n")
            report = await _exchange(server, b"POST /report HTTP/1.1\r\nHost: d\r\n"
                                             b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        finally:
            await server.shutdown(1.0)
        return health, report

    health, report = asyncio.run(go())
    assert health.startswith(b"HTTP/1.1 200 ")
    assert b'"status":"ok"' in health
    assert report.startswith(b"HTTP/1.1 401 ")


def test_a_100_kb_header_is_refused_with_431() -> None:
    """One 100 KB header (uvicorn took it with 200) is answered 431 and the socket closed."""
    async def go() -> bytes:
        server = await serve_api(_daemon(), "127.0.0.1:0", token=TOKEN)
        try:
            return await _exchange(server, b"GET /health HTTP/1.1\r\nHost: d\r\nX-Big: "
                                   + b"a" * 100_000 + b"\r\n\r\n")
        finally:
            await server.shutdown(1.0)

    assert asyncio.run(go()).startswith(b"HTTP/1.1 431 ")


def test_a_slowloris_client_is_answered_408_and_closed() -> None:
    """A head that never ends is answered 408 once the request timeout passes, then closed
    (uvicorn kept 50 such connections open 45 s)."""
    async def go() -> tuple[bytes, float]:
        server = await serve_api(_daemon(), "127.0.0.1:0", token=TOKEN, request_timeout_s=0.3)
        try:
            port = int(server.address.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(b"GET /health HTTP/1.1\r\nHost: d\r\n")
            for _ in range(3):  # a header now and then, never the blank line
                await asyncio.sleep(0.05)
                writer.write(b"X-Slow: 1\r\n")
            answer = await asyncio.wait_for(reader.read(), 5.0)  # b"" only once closed
            writer.close()
            return answer, time.monotonic() - started
        finally:
            await server.shutdown(1.0)

    answer, elapsed = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert 0.25 <= elapsed < 5.0


def test_an_address_that_cannot_be_bound_is_invalid_input() -> None:
    """A busy port or a malformed address is one `InvalidInput` naming it."""
    async def go() -> None:
        server = await serve_api(_daemon(), "127.0.0.1:0", token=None)
        try:
            busy = server.address.removeprefix("http://")
            with pytest.raises(InvalidInput, match=f"cannot listen on {busy}"):
                await serve_api(_daemon(), busy, token=None)
        finally:
            await server.shutdown(1.0)

    asyncio.run(go())
    with pytest.raises(InvalidInput, match="expected HOST:PORT"):
        split_listen("localhost")
    assert split_listen("[::1]:9400") == ("::1", 9400)
