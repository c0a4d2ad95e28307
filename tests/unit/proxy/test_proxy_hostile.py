"""The proxy's front door against hostile bodies and bytes: strict JSON (depth, NaN),
and fuzzing that must never get a 500 or take the proxy down."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl.openai import MAX_JSON_DEPTH, parse_request_json
from tests import hostile
from tests.unit.proxy.test_proxy import (
    BODY,
    MODEL,
    Cluster,
    FakeWorker,
    expected_text,
    run,
    stream_text,
)

__all__ = ["run"]  # the fixture

BAD_JSON = [
    (b"[" * 100_000, "nested deeper than 64"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 64"),
    (b'{"model": "m", "prompt": "hi", "max_tokens": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "hi", "temperature": Infinity}', "Infinity is not a JSON number"),
    (b'{"prompt": "hi", "temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "hi", "temperature": 1e999}', "number out of range: 1e999"),
]


@pytest.mark.parametrize(("data", "reason"), BAD_JSON)
def test_parse_request_json_refuses_deep_nesting_and_non_finite_numbers(
        data: bytes, reason: str) -> None:
    """Deeper than MAX_JSON_DEPTH, NaN, Infinity and 1e999 are a ValueError naming why."""
    with pytest.raises(ValueError, match=reason):
        parse_request_json(data)


def test_parse_request_json_takes_what_strict_json_allows() -> None:
    """Nesting up to the limit, brackets inside strings and lone-surrogate escapes
    (for the engine to refuse) are read."""
    deep = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_request_json(deep) is not None
    assert parse_request_json(b'{"prompt": "' + b"[" * 500 + b'"}') == {"prompt": "[" * 500}
    assert parse_request_json('{"prompt": "\\ud800"}') == {"prompt": "\ud800"}
    with pytest.raises(ValueError, match="nested deeper"):
        parse_request_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))


@pytest.mark.parametrize(("data", "reason"), BAD_JSON)
def test_the_front_door_answers_400_to_deep_or_non_finite_json(data: bytes,
                                                                reason: str) -> None:
    """100k nested `[`, NaN and Infinity get an OpenAI-style 400, never a 500, and no
    worker sees them."""
    async def go() -> None:
        worker = FakeWorker()
        async with Cluster([worker]) as c:
            response = await c.client.post("/v1/completions", content=data,
                                           headers={"content-type": "application/json"})
            assert response.status == 400
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert reason in error["message"]
            assert worker.requests == []
    asyncio.run(asyncio.wait_for(go(), 60))


class LiveProxy:
    """The proxy's lean front door over two fake workers, on an event loop of its own
    thread, for tests that drive it with blocking sockets (hypothesis)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.cluster = Cluster([FakeWorker(), FakeWorker()])
        self.port = 0

    def __enter__(self) -> LiveProxy:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.cluster.__aenter__(), self.loop).result(60)
        assert self.cluster.server is not None
        self.port = int(self.cluster.server.address.rsplit(":", 1)[1])
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.cluster.__aexit__(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live_proxy() -> Iterator[LiveProxy]:
    """One proxy for every example of the fuzz tests of this module."""
    with LiveProxy() as proxy:
        yield proxy


FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(data=hostile.RAW_REQUESTS)
def test_random_bytes_at_the_front_door_never_get_a_500(live_proxy: LiveProxy,
                                                        data: bytes) -> None:
    """Any bytes get a well-formed answer (or none, when they are half a request), never a
    500, and the proxy answers its health check after them."""
    hostile.assert_answered_sanely(hostile.exchange(live_proxy.port, data, half_close=True))
    hostile.assert_alive(live_proxy.port)


@FUZZ
@given(data=hostile.request_payloads(MODEL), path=st.sampled_from(["/v1/completions",
                                                           "/v1/chat/completions"]))
def test_random_json_at_the_front_door_never_gets_a_500(live_proxy: LiveProxy, data: bytes,
                                                        path: str) -> None:
    """Any body (JSON with NaN or Infinity, deep nesting, bytes) gets an answer that is not
    a 500, a 400 when it is not strict JSON; the proxy stays up."""
    answer = hostile.exchange(live_proxy.port, hostile.post(path, data))
    hostile.assert_answered_sanely(answer)
    assert hostile.status_of(answer) is not None
    try:
        parse_request_json(data)
    except ValueError:
        assert hostile.status_of(answer) == 400, answer[:300]
    hostile.assert_alive(live_proxy.port)


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_out_of_range_never_reach_the_client(run: Callable[..., Any],
                                                       stream: bool) -> None:
    """Issue 29 case 7: a worker that answers ids [-5, 2**70] is read as one without ids from
    then on (text): the client gets the text and no id of the lie."""
    async def go() -> None:
        async with Cluster([FakeWorker(lie_ids_at=4)]) as c:
            body = {**BODY, "return_token_ids": True}
            if stream:
                resp, events = await c.stream("/v1/completions", body)
                chunks = [e for e in events if isinstance(e, dict)]
                text = stream_text(events)
            else:
                resp = await c.client.post("/v1/completions", json={**body, "stream": False})
                chunks = [resp.json()]
                text = resp.json()["choices"][0]["text"]
            assert resp.status == 200
            assert text == expected_text("hello world", 5, 20)
            seen = [i for chunk in chunks for choice in chunk.get("choices", ())
                    for i in choice.get("token_ids") or ()]
            assert all(0 <= i < 2**31 for i in seen), seen
    run(go())


def test_a_flood_of_stop_strings_is_refused_and_health_stays_fast(
        run: Callable[..., Any]) -> None:
    """Issue 29 case 7: 2,000,000 stop strings are a 400 naming 'stop' (the proxy matches
    stops itself, per token), no worker is asked, and /health answers meanwhile."""
    async def go() -> None:
        worker = FakeWorker()
        async with Cluster([worker]) as c:
            flood = c.client.post("/v1/completions", json={
                **BODY, "stream": False, "stop": ["x"] * 2_000_000})
            health = c.client.get("/health")
            resp, ok = await asyncio.gather(flood, health)
            assert ok.status == 200
            assert resp.status == 400
            assert resp.json()["error"]["param"] == "stop"
            resp = await c.client.post("/v1/completions", json={
                **BODY, "stream": False, "stop": [f"s{i}" for i in range(64)]})
            assert resp.status == 200
            assert not [r for r in worker.requests if "stop" in r]
    run(go())
