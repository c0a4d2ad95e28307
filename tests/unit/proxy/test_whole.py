"""Whole upstream answers (`proxy.whole_max_tokens`): a client that does not stream and asks
for few tokens gets one non-streamed upstream answer, and every failure of it goes where
a failed stream's goes: elsewhere, with the worker charged, and the client never sees it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl import metrics
from dynamo_ftctl.proxy.serve import MIGRATED_HEADER
from tests.unit.proxy.test_proxy import BODY, Cluster, FakeWorker, expected_text, run
from tests.waiting import until

__all__ = ["run"]  # the fixture

WHOLE = {**BODY, "stream": False}
ANSWER = expected_text("hello world", 5, 20)


def _sent_whole(fake: FakeWorker) -> bool:
    """Every request `fake` got asked for a whole answer (no stream, no stream options)."""
    return bool(fake.requests) and all(
        r["stream"] is False and "stream_options" not in r for r in fake.requests)


def _sample(name: str) -> float:
    """A sample of the proxy's registry for the fake model (one registry per process)."""
    return metrics.REGISTRY.get_sample_value(name, {"model": BODY["model"]}) or 0.0


def test_a_whole_answer_is_one_upstream_answer(run: Callable[..., Any]) -> None:
    """The worker is asked once, not to stream; the client's answer is the generation, with
    the proxy's id, usage and count header; Dynamo's duration counts it, its time to first
    token does not (no token is seen before the end)."""
    async def go() -> None:
        async with Cluster([FakeWorker()], whole_max_tokens=20) as c:
            durations = _sample("dynamo_frontend_request_duration_seconds_count")
            firsts = _sample("dynamo_frontend_time_to_first_token_seconds_count")
            resp = await c.client.post("/v1/completions", json=WHOLE)
            assert _sample("dynamo_frontend_request_duration_seconds_count") == durations + 1
            assert _sample("dynamo_frontend_time_to_first_token_seconds_count") == firsts
            assert resp.status == 200
            doc = resp.json()
            assert doc["choices"][0]["text"] == ANSWER
            assert doc["choices"][0]["finish_reason"] == "length"
            assert doc["usage"]["completion_tokens"] == 20
            assert doc["id"] == f"cmpl-{resp.headers['x-request-id']}"
            assert resp.headers["x-ftctl-worker"] == "w0"
            assert resp.headers["x-ftctl-count"] == "ids"
            assert _sent_whole(c.workers[0])
            # Past the threshold, and for a streaming client, the worker streams.
            c.workers[0].forget()
            resp = await c.client.post("/v1/completions", json={**WHOLE, "max_tokens": 21})
            assert resp.status == 200
            assert [r["stream"] for r in c.workers[0].requests] == [True]
    run(go())


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), with_ids=st.booleans(), max_tokens=st.integers(1, 24),
       seed=st.integers(0, 1000), stop=st.sampled_from([None, "A", ["Q", "ZZ"]]))
def test_a_whole_answer_reads_as_the_streamed_one(run: Callable[..., Any], chat: bool,
                                                  with_ids: bool, max_tokens: int, seed: int,
                                                  stop: Any) -> None:
    """Any request answered whole gets the document its stream would have given: the same
    text, finish reason, usage and ids (chat or not, with ids or text, stop strings)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": BODY["model"], "max_tokens": max_tokens, "seed": seed,
                            "stream": False, "return_token_ids": with_ids}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello world"}]
    else:
        body["prompt"] = "hello world"
    if stop is not None:
        body["stop"] = stop

    async def go() -> None:
        async with Cluster([FakeWorker(with_ids=with_ids)], whole_max_tokens=24) as c:
            whole = await c.client.post(path, json=body)
            config = c.proxy.front_door.config
            c.proxy.front_door.config = msgspec.structs.replace(config, whole_max_tokens=0)
            streamed = await c.client.post(path, json=body)
            assert [r["stream"] for r in c.workers[0].requests] == [False, True]
        assert whole.status == streamed.status == 200
        one, other = whole.json(), streamed.json()
        for doc in (one, other):
            del doc["id"], doc["created"]
        # A stream cut at a stop string is not read to its usage chunk: where it had no ids,
        # its prompt count is 0 and the whole answer's is the worker's.
        usage, streamed_usage = one.pop("usage"), other.pop("usage")
        assert usage["completion_tokens"] == streamed_usage["completion_tokens"]
        assert streamed_usage["prompt_tokens"] in {0, usage["prompt_tokens"]}
        assert one == other
        assert whole.headers.get("x-ftctl-continuation") == \
            streamed.headers.get("x-ftctl-continuation")
        # A stream without ids cut at a stop string counts its chunks; the whole answer has
        # the worker's usage.
        assert whole.headers["x-ftctl-count"] in {streamed.headers["x-ftctl-count"], "usage"}
    run(go())


@pytest.mark.parametrize("mode", ["hangup", "html502", "html200", "bad_json", "error_event",
                                  "no_finish", "stall"])
@pytest.mark.parametrize("sick", [False, True])
def test_a_failed_whole_answer_runs_again_elsewhere(run: Callable[..., Any], mode: str,
                                                    sick: bool) -> None:
    """A whole answer lost in any way (hung up on, an error page, bad JSON, an error, no
    finish reason, never sent) is asked again of another worker, from its start: the client
    gets the whole generation, nothing of the failure, and the worker is charged once."""
    async def go() -> None:
        bad = FakeWorker(mode="ok" if mode == "hangup" else mode, fail_after=3, sick=sick)
        async with Cluster([bad, FakeWorker()], stall_timeout_s=0.3,
                           whole_max_tokens=20) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5  # w0 first
            resp = await c.client.post("/v1/completions", json=WHOLE)
            assert resp.status == 200, resp.body
            doc = resp.json()
            assert doc["choices"][0]["text"] == ANSWER
            assert doc["usage"]["completion_tokens"] == 20
            assert resp.headers["x-ftctl-worker"] == "w0,w1"
            assert resp.headers[MIGRATED_HEADER] == "1"  # a retry (method="retry")
            assert _sent_whole(c.workers[0])
            assert _sent_whole(c.workers[1])
            assert c.fleet.balancer.slots["w0"].charges == 1
    run(go())


def test_a_hung_worker_is_found_by_its_probe(run: Callable[..., Any]) -> None:
    """A worker that keeps a whole answer waiting and fails the known-good probe asked after
    `stall_timeout_s` loses the request to another worker within about two periods, not
    the `(max_tokens + 1)` periods a live worker is given."""
    async def go() -> None:
        hung = FakeWorker(mode="stall", fail_after=0, sick=True)
        async with Cluster([hung, FakeWorker()], stall_timeout_s=0.5,
                           whole_max_tokens=20) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            started = time.monotonic()
            resp = await c.client.post("/v1/completions", json=WHOLE)
            took = time.monotonic() - started
            assert resp.status == 200
            assert resp.json()["choices"][0]["text"] == ANSWER
            assert hung.probes >= 1
            assert took < 0.5 * 21  # far less than the live worker's bound (10.5 s)
            await until(lambda: hung.disconnects == 1)  # the wait was hung up on
    run(go())


def test_a_live_worker_is_given_the_time_a_stream_may_take(run: Callable[..., Any]) -> None:
    """A worker that answers the probe keeps the request until `(max_tokens + 1)` periods of
    `stall_timeout_s` have passed with no answer; then it goes elsewhere."""
    async def go() -> None:
        slow = FakeWorker(gate=asyncio.Event())  # never set: answers probes, not requests
        async with Cluster([slow, FakeWorker()], stall_timeout_s=0.3,
                           whole_max_tokens=20) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            started = time.monotonic()
            resp = await c.client.post("/v1/completions", json={**WHOLE, "max_tokens": 3})
            took = time.monotonic() - started
            assert resp.status == 200
            assert resp.json()["choices"][0]["text"] == expected_text("hello world", 5, 3)
            assert took >= 0.3 * 4
            assert slow.probes >= 2  # asked each period, and it answered
            assert c.fleet.balancer.slots["w0"].charges == 1
    run(go())


def test_a_worker_that_is_full_is_spared(run: Callable[..., Any]) -> None:
    """A 429 to a whole request is backpressure: the worker is spared, nothing charged, the
    request served elsewhere."""
    async def go() -> None:
        async with Cluster([FakeWorker(mode="busy429"), FakeWorker()],
                           whole_max_tokens=20) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp = await c.client.post("/v1/completions", json=WHOLE)
            assert resp.status == 200
            assert json.loads(resp.body)["choices"][0]["text"] == ANSWER
            w0 = c.fleet.balancer.slots["w0"]
            assert w0.charges == 0
            assert w0.spared_until > 0
    run(go())


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_off_by_default_whatever_max_tokens_says(run: Callable[..., Any],
                                                 max_tokens: int) -> None:
    """`whole_max_tokens: 0` (the default) streams every upstream request, also one whose
    max_tokens is 0 or less (the worker answers what it makes of those)."""
    async def go() -> None:
        async with Cluster([FakeWorker()]) as c:
            await c.client.post("/v1/completions", json={**WHOLE, "max_tokens": max_tokens})
            assert [r["stream"] for r in c.workers[0].requests] == [True]
    run(go())
