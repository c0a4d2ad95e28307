"""`http1.transport`: the one seam, its mock, and the two real clients behind it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dynamo_ftctl import httpserver
from dynamo_ftctl.http1 import (
    BlockingClient,
    BodyTooLarge,
    Client,
    MockTransport,
    NoConnection,
    Reply,
    Request,
)
from dynamo_ftctl.httpapp import BackgroundServer, Router, json_reply, request_json


async def _echo(request: httpserver.Request) -> httpserver.Reply:
    auth = (request.header(b"authorization") or b"").decode()
    return json_reply({"got": request_json(request), "auth": auth}, 201, {"X-Seen": "yes"})


async def _big(_request: httpserver.Request) -> httpserver.Reply:
    return json_reply({"pad": "x" * 4096})


@pytest.fixture
def server() -> Iterator[BackgroundServer]:
    router = Router()
    router.post("/echo", _echo)
    router.get("/big", _big)
    with BackgroundServer(router, "127.0.0.1", 0).start() as running:
        yield running


def _echo_request(server: BackgroundServer) -> Request:
    return Request("POST", f"{server.address}/echo", b'{"a":1}',
                   {"Authorization": "Bearer t"}, timeout_s=5)


def test_the_blocking_client_answers_status_headers_and_body(server: BackgroundServer) -> None:
    """A `BlockingClient` exchange gives one `Reply`: status, lower-case headers, body."""
    reply = BlockingClient().handle_request(_echo_request(server))
    assert reply.status == 201
    assert reply.json() == {"got": {"a": 1}, "auth": "Bearer t"}
    assert reply.header("X-Seen") == "yes"
    assert reply.content_type.startswith("application/json")
    assert reply.first_byte_s is not None
    assert reply.first_byte_s >= 0


def test_the_async_client_gives_the_same_reply(server: BackgroundServer) -> None:
    """`Client.handle_async_request` and the blocking client agree on one exchange."""

    async def ask() -> Reply:
        client = Client()
        try:
            return await client.handle_async_request(_echo_request(server))
        finally:
            await client.close()

    reply = asyncio.run(ask())
    blocking = BlockingClient().handle_request(_echo_request(server))
    assert (reply.status, reply.body, reply.header("x-seen")) == \
        (blocking.status, blocking.body, blocking.header("x-seen"))


def test_a_body_over_the_request_limit_is_refused(server: BackgroundServer) -> None:
    """`Request.limit` caps the body read whole: `BodyTooLarge`, not a 4 KiB answer."""
    with pytest.raises(BodyTooLarge):
        BlockingClient().handle_request(Request("GET", f"{server.address}/big", limit=1024))


def test_the_mock_answers_both_ways_with_its_handler() -> None:
    """`MockTransport(handler)` serves blocking and awaited calls from one handler."""
    seen: list[Request] = []

    def handler(request: Request) -> Reply:
        seen.append(request)
        return Reply(200, b'{"n":%d}' % len(seen), {"content-type": "application/json"})

    mock = MockTransport(handler)
    assert mock.handle_request(Request("GET", "http://w/a")).json() == {"n": 1}
    assert asyncio.run(mock.handle_async_request(Request("GET", "http://w/b"))).json() == {"n": 2}
    assert [r.url for r in seen] == ["http://w/a", "http://w/b"]


def test_the_mock_raises_what_its_handler_raises() -> None:
    """A handler's `NoConnection` reaches the caller as a real client's would."""

    def handler(request: Request) -> Reply:
        raise NoConnection(f"refused: {request.url}")

    with pytest.raises(NoConnection, match="refused: http://w/"):
        MockTransport(handler).handle_request(Request("GET", "http://w/"))


def test_an_async_handler_serves_awaited_calls_only() -> None:
    """An async handler is awaited by `handle_async_request`; a blocking call refuses it."""

    async def handler(_request: Request) -> Reply:
        return Reply(204)

    mock = MockTransport(handler)
    assert asyncio.run(mock.handle_async_request(Request("GET", "http://w/"))).status == 204
    with pytest.raises(TypeError, match="returns a Reply"):
        mock.handle_request(Request("GET", "http://w/"))


def test_the_seam_loads_without_asyncio_or_ssl() -> None:
    """The one-shot probe takes the seam: importing it loads neither asyncio nor ssl."""
    code = ("import sys\nfrom dynamo_ftctl.http1 import MockTransport, Reply, Request, Transport\n"
            "print(sorted(m for m in ('asyncio', 'ssl') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == "[]"


def test_the_async_client_opens_a_stream_read_as_it_comes(server: BackgroundServer) -> None:
    """`Client.open_stream` gives the answer once its headers are in; `next_chunk` reads the
    body to b"" (a `StreamingTransport`)."""

    async def ask() -> tuple[int | None, str | None, bytes]:
        client = Client()
        try:
            stream = await client.open_stream(_echo_request(server))
            try:
                parts = []
                while piece := await stream.next_chunk(5):
                    parts.append(piece)
                return stream.status, stream.header("x-seen"), b"".join(parts)
            finally:
                stream.close()
        finally:
            await client.close()

    assert asyncio.run(ask()) == (201, "yes", b'{"got":{"a":1},"auth":"Bearer t"}')
