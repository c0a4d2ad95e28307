"""`http1.fetch_blocking`: one exchange from blocking code, inside a running loop too."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from dynamo_ftctl.http1 import ConnectError, fetch_blocking
from dynamo_ftctl.httpapp import BackgroundServer, Router, json_reply, request_json
from dynamo_ftctl.httpserver import Reply, Request


async def _echo(request: Request) -> Reply:
    auth = (request.header(b"authorization") or b"").decode()
    return json_reply({"got": request_json(request), "auth": auth}, 201)


async def _slow(_request: Request) -> Reply:
    await asyncio.sleep(5)
    return json_reply({})


@pytest.fixture
def server() -> Iterator[BackgroundServer]:
    router = Router()
    router.post("/echo", _echo)
    router.get("/slow", _slow)
    with BackgroundServer(router, "127.0.0.1", 0).start() as running:
        yield running


def test_a_post_comes_back_with_its_status_and_body(server: BackgroundServer) -> None:
    """Body, headers and status travel both ways."""
    status, body = fetch_blocking("POST", f"{server.address}/echo", b'{"a":1}',
                                  {"Authorization": "Bearer t"}, timeout_s=5)
    assert status == 201
    assert body == b'{"got":{"a":1},"auth":"Bearer t"}'


def test_inside_a_running_loop_it_runs_on_a_helper_thread(server: BackgroundServer) -> None:
    """A blocking call made from async code (a lock's release) still gets its answer."""

    async def from_a_loop() -> tuple[int, bytes]:
        return fetch_blocking("POST", f"{server.address}/echo", b"2", timeout_s=5)

    assert asyncio.run(from_a_loop()) == (201, b'{"got":2,"auth":""}')


def test_a_refused_connection_is_a_connect_error() -> None:
    """No listener: http1's ConnectError (an OSError), not a hang."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError):
        fetch_blocking("GET", f"http://127.0.0.1:{port}/", timeout_s=5)


def test_the_deadline_holds(server: BackgroundServer) -> None:
    """An answer slower than `timeout_s` is a TimeoutError at the deadline."""
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        fetch_blocking("GET", f"{server.address}/slow", timeout_s=0.2)
    assert time.monotonic() - started < 2
