"""A worker the proxy could not connect to says nothing about the request: when only such
workers are left, the request tries them again within `stall_timeout_s`; a worker that
failed it any other way is never tried again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from dynamo_ftctl.http1 import ConnectTimeout, NoConnection
from dynamo_ftctl.http1.pool import Pool
from dynamo_ftctl.httpserver import start_server
from tests.unit.proxy.test_proxy import (
    BODY,
    Cluster,
    FakeWorker,
    expected_text,
    run,
    stream_text,
)
from tests.waiting import until

__all__ = ["run"]  # the fixture


def _errors(events: list[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, dict) and "error" in e]


def test_a_continuation_waits_for_the_last_worker_it_could_not_reach(
        run: Callable[..., Any]) -> None:
    """w0 cuts the stream; w1 refuses connections, then comes back on its port: the stream
    goes on there, token for token, and w0 (which lost it) is not asked again."""
    async def go() -> None:
        workers = [FakeWorker(fail_after=5), FakeWorker()]
        async with Cluster(workers, stall_timeout_s=30.0, migration_limit=100) as c:
            port = urlsplit(workers[1].url).port
            await c.stop_worker(1)
            c.fleet.balancer.slots["w1"].outstanding = 1  # it starts on w0
            streaming = asyncio.ensure_future(c.stream("/v1/completions", BODY))
            # The continuation found w1 refusing at least once before it is back.
            await until(lambda: c.fleet.balancer.slots["w1"].charges >= 1, 20.0,
                        "the continuation refused by w1")
            assert not streaming.done()
            workers[1].server = await start_server(workers[1].route, "127.0.0.1", port)
            resp, events = await asyncio.wait_for(streaming, 60.0)
            assert resp.status == 200
            assert _errors(events) == []
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert len(workers[0].requests) == 1
            assert len(workers[1].requests) == 1
    run(go())


def test_a_request_that_reaches_no_worker_ends_within_the_stall_timeout(
        run: Callable[..., Any]) -> None:
    """w1 never comes back: the stream ends with an error once `stall_timeout_s` has
    passed since w1 first refused it, not after `migration_limit` tries."""
    async def go() -> None:
        workers = [FakeWorker(fail_after=5), FakeWorker()]
        async with Cluster(workers, stall_timeout_s=0.5, migration_limit=100) as c:
            await c.stop_worker(1)
            c.fleet.balancer.slots["w1"].outstanding = 1
            resp, events = await asyncio.wait_for(c.stream("/v1/completions", BODY), 60.0)
            assert resp.status == 200  # the stream had begun
            error, = _errors(events)
            assert "no other healthy worker" in error["error"]["message"]
            assert stream_text(events) == expected_text("hello world", 5, 5)
            assert len(workers[0].requests) == 1  # lost it: never asked again
    run(go())


@pytest.mark.parametrize("answer", ["http500", "event500"])
def test_a_worker_that_failed_the_request_otherwise_is_not_tried_again(
        run: Callable[..., Any], answer: str) -> None:
    """w0 fails the request (an answer, not a connection issue); w1 refuses connections:
    only w1 is tried again, w0 sees the request once."""
    async def go() -> None:
        workers = [FakeWorker(poison="hello", poison_answer=answer), FakeWorker()]
        async with Cluster(workers, stall_timeout_s=0.5, migration_limit=100) as c:
            await c.stop_worker(1)
            c.fleet.balancer.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status in (502, 503), resp.text
            assert len(workers[0].requests) == 1
    run(go())


def test_a_connect_timeout_is_no_connection_and_a_timeout() -> None:
    """The pool's connect timeout says the server never saw the request (the proxy's
    judgment: "unreachable") and is still a `TimeoutError` to those that only ask that."""
    async def go() -> None:
        loop = asyncio.get_running_loop()

        async def never(*_args: Any, **_kwargs: Any) -> Any:
            await asyncio.Event().wait()

        loop.create_connection = never  # type: ignore[method-assign]
        pool = Pool()
        with pytest.raises(ConnectTimeout) as caught:
            await pool.open(("http", "127.0.0.1", 9), 0.05)
        assert isinstance(caught.value, NoConnection)
        assert isinstance(caught.value, TimeoutError)
        assert "within 0.05 s" in str(caught.value)

    asyncio.run(go())
