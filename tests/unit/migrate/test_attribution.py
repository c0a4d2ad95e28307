"""Whose fault a failed request is: the request's (4xx, query of death) or a worker's, and
the retry budget that keeps failing requests from multiplying the load (issue 22)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_ftctl import metrics
from tests.loopback import until
from tests.unit.migrate.test_proxy import (
    BODY,
    Cluster,
    FakeWorker,
    expected_text,
    fake_daemon,
    run,
    stream_text,
)

__all__ = ["run"]  # the fixture

POISON = {**BODY, "prompt": "POISON", "stream": False}


def counted(name: str) -> float:
    """A counter of the proxy's registry (one per process: compare before and after)."""
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def charged(c: Cluster) -> dict[str, int]:
    """Failures charged to each worker (confirmed by a failed known-good probe or not)."""
    return {name: slot.charges for name, slot in c.fleet.router.slots.items()}


def test_poison_requests_leave_the_cluster_up(run: Callable[..., Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 finding 1: requests that get a 500 from every worker end after two workers as
    a query of death (502), charge no worker, report nothing to the daemon; then a normal
    request is served, every breaker closed."""
    monkeypatch.setenv("FTCTL_DAEMON_TOKEN", "d4emon")  # reports go out only with a token

    async def go() -> None:
        before = counted("ftctl_proxy_query_of_death_total")
        async with fake_daemon({"w0": 1.0, "w1": 1.0}) as (url, reports):
            workers = [FakeWorker(poison="POISON"), FakeWorker(poison="POISON")]
            async with Cluster(workers, health_url=url) as c:
                for _ in range(4):  # more than breaker_threshold (3)
                    resp = await c.client.post("/v1/completions", json=POISON)
                    assert resp.status_code == 502
                    error = resp.json()["error"]
                    assert error["type"] == "query_of_death"
                    assert "HTTP 500" in error["message"]
                    assert "two workers" in error["message"]
                assert [len(w.requests) for w in workers] == [4, 4]
                assert charged(c) == {"w0": 0, "w1": 0}
                assert {s.breaker for s in c.fleet.router.slots.values()} == {"closed"}
                resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
                assert resp.status_code == 200
                assert resp.json()["choices"][0]["text"] == expected_text("hello world", 5, 20)
                # A real worker failure now: its report is the only one the daemon gets.
                workers[0].mode = workers[1].mode = "html502"
                resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
                assert resp.status_code == 502
                await until(lambda: len(reports) == 2)
                assert all("HTTP 502" in r["reason"] for r in reports), reports
        assert counted("ftctl_proxy_query_of_death_total") == before + 4
    run(go())


@pytest.mark.parametrize("answer", ["http500", "reset", "event500"])
def test_the_same_failure_on_two_workers_stops_there(run: Callable[..., Any],
                                                     answer: str) -> None:
    """A 500, a connection lost before any answer, or an error event, twice in a row: the
    third worker is never asked, and the streamed client gets a 502 query_of_death."""
    async def go() -> None:
        workers = [FakeWorker(poison="POISON", poison_answer=answer) for _ in range(3)]
        async with Cluster(workers) as c:
            resp, _ = await c.stream("/v1/completions", POISON)
            assert resp.status_code == 502
            # (A connection closed before any answer is sent once more on a new one: the
            # pool's keep-alive race, so a worker may see it twice.)
            assert sum(not w.requests for w in workers) == 1
            assert charged(c) == {"w0": 0, "w1": 0, "w2": 0}
    run(go())


def test_two_different_failures_are_both_charged(run: Callable[..., Any]) -> None:
    """A 500 on one worker and a lost connection on the next are no query of death: the
    third worker serves the request, and both failed workers are charged."""
    async def go() -> None:
        workers = [FakeWorker(poison="hello", poison_answer="http500"),
                   FakeWorker(poison="hello", poison_answer="reset"), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.router.slots["w1"].outstanding = 1
            c.fleet.router.slots["w2"].outstanding = 2  # tried in the order w0, w1, w2
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status_code == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert charged(c) == {"w0": 1, "w1": 1, "w2": 0}
    run(go())


def test_a_failure_once_is_charged_when_another_worker_serves(run: Callable[..., Any]) -> None:
    """A 500 from one worker, then the request served by another: the first is charged."""
    async def go() -> None:
        workers = [FakeWorker(poison="hello"), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.router.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status_code == 200
            assert charged(c) == {"w0": 1, "w1": 0}
    run(go())


def test_a_stream_cut_twice_goes_on_to_a_third_worker(run: Callable[..., Any]) -> None:
    """A stream cut mid-way (a killed worker), then its continuation cut before its first
    token: no query of death, the third worker finishes it identically."""
    async def go() -> None:
        workers = [FakeWorker(fail_after=5), FakeWorker(fail_after=0), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.router.slots["w1"].outstanding = 1
            c.fleet.router.slots["w2"].outstanding = 2
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status_code == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert all("error" not in e for e in events if isinstance(e, dict))
            assert charged(c) == {"w0": 1, "w1": 1, "w2": 0}
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_4xx_error_event_is_the_clients(run: Callable[..., Any], stream: bool) -> None:
    """An SSE error event with code 400 before any token is the request's: the client gets
    that 400, no other worker is asked, no worker is charged."""
    async def go() -> None:
        workers = [FakeWorker(poison="POISON", poison_answer="event400"), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.router.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**POISON, "stream": stream})
            assert resp.status_code == 400
            assert resp.json()["error"] == {"message": "error 400", "type": "BadRequestError",
                                            "param": None, "code": 400}
            assert not workers[1].requests
            assert charged(c) == {"w0": 0, "w1": 0}
    run(go())


def test_a_4xx_answer_closes_a_half_open_breaker(run: Callable[..., Any]) -> None:
    """A worker on trial (half-open) that refuses a request with 400 has answered: its
    breaker closes instead of waiting forever for its trial's outcome."""
    async def go() -> None:
        async with Cluster([FakeWorker(max_model_len=5)]) as c:
            slot = c.fleet.router.slots["w0"]
            slot.breaker = "half_open"
            resp = await c.client.post("/v1/completions", json=BODY)
            assert resp.status_code == 400
            assert slot.breaker == "closed"
            assert c.fleet.router.weight(slot) == 1.0
    run(go())


def test_without_a_retry_budget_a_failed_request_is_not_retried(run: Callable[..., Any]) -> None:
    """retry_budget 0% with no minimum: a worker's 502 ends the request with a 503
    retry_budget_exhausted and Retry-After; the other worker is never asked."""
    async def go() -> None:
        before = counted("ftctl_proxy_retry_budget_exhausted_total")
        workers = [FakeWorker(mode="html502"), FakeWorker()]
        budget = {"budget_percent": 0, "min_retry_concurrency": 0}
        async with Cluster(workers, retry_budget=budget) as c:
            c.fleet.router.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status_code == 503
            assert resp.headers["retry-after"] == "1"
            error = resp.json()["error"]
            assert error["type"] == "retry_budget_exhausted"
            assert "HTTP 502" in error["message"]
            assert not workers[1].requests
            assert charged(c) == {"w0": 1, "w1": 0}
        assert counted("ftctl_proxy_retry_budget_exhausted_total") == before + 1
    run(go())


def test_a_worker_that_went_away_is_retried_whatever_the_budget(
        run: Callable[..., Any]) -> None:
    """A worker that drops the connection before answering did no work a retry repeats:
    the load moves, it does not multiply, so a budget of 0 still lets the request go on
    (a SIGKILLed vLLM's queued requests got 503 past the budget in CI) and the worker is
    charged once the other one serves it."""
    async def go() -> None:
        before = counted("ftctl_proxy_retry_budget_exhausted_total")
        workers = [FakeWorker(poison="POISON", poison_answer="reset"), FakeWorker()]
        budget = {"budget_percent": 0, "min_retry_concurrency": 0}
        async with Cluster(workers, retry_budget=budget) as c:
            c.fleet.router.slots["w1"].outstanding = 1  # it starts on w0
            resp = await c.client.post("/v1/completions", json=POISON)
            assert resp.status_code == 200, resp.text
            assert len(workers[1].requests) == 1
            assert charged(c) == {"w0": 1, "w1": 0}
        assert counted("ftctl_proxy_retry_budget_exhausted_total") == before
    run(go())


@pytest.mark.parametrize(("percent", "status"), [(0.0, 503), (100.0, 200)])
def test_retries_in_flight_are_capped_by_the_budget(run: Callable[..., Any], percent: float,
                                                    status: int) -> None:
    """With one retry waiting for its first token, a second failed request is retried only
    if the budget (min 1, `percent` of the 2 requests in flight) has room for it."""
    async def go() -> None:
        gate = asyncio.Event()
        workers = [FakeWorker(mode="html502"), FakeWorker(gate=gate)]
        budget = {"budget_percent": percent, "min_retry_concurrency": 1}
        async with Cluster(workers, retry_budget=budget) as c:
            c.fleet.router.slots["w1"].outstanding = 5  # both requests start on w0
            body = {**BODY, "stream": False}
            first = asyncio.ensure_future(c.client.post("/v1/completions", json=body))
            await until(lambda: len(workers[1].requests) == 1)  # its retry waits on w1
            second = asyncio.ensure_future(c.client.post("/v1/completions", json=body))
            if status == 503:
                assert (await second).status_code == 503
            else:
                await until(lambda: len(workers[1].requests) == 2)
            gate.set()
            assert (await first).status_code == 200
            assert (await second).status_code == status
    run(go())
