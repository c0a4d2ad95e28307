"""Whose fault a failed request is: the request's (4xx, query of death) or a worker's, and
the retry budget that keeps failing requests from multiplying the load (issue 22)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_ftctl import metrics
from dynamo_ftctl.proxy.judgment import fingerprint
from tests.unit.proxy.test_proxy import (
    BODY,
    Cluster,
    FakeWorker,
    expected_text,
    fake_daemon,
    run,
    stream_text,
)
from tests.waiting import until

__all__ = ["run"]  # the fixture

POISON = {**BODY, "prompt": "POISON", "stream": False}


def counted(name: str) -> float:
    """A counter of the proxy's registry (one per process: compare before and after)."""
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def charged(c: Cluster) -> dict[str, int]:
    """Failures charged to each worker (confirmed by a failed known-good probe or not)."""
    return {name: slot.charges for name, slot in c.fleet.balancer.slots.items()}


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
                    assert resp.status == 502
                    error = resp.json()["error"]
                    assert error["type"] == "query_of_death"
                    assert "HTTP 500" in error["message"]
                    assert "two workers" in error["message"]
                assert [len(w.requests) for w in workers] == [4, 4]
                assert charged(c) == {"w0": 0, "w1": 0}
                assert {s.breaker for s in c.fleet.balancer.slots.values()} == {"closed"}
                resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
                assert resp.status == 200
                assert resp.json()["choices"][0]["text"] == expected_text("hello world", 5, 20)
                # A real worker failure now: its report is the only one the daemon gets.
                workers[0].mode = workers[1].mode = "html502"
                resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
                assert resp.status == 502
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
            assert resp.status == 502
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
            c.fleet.balancer.slots["w1"].outstanding = 1
            c.fleet.balancer.slots["w2"].outstanding = 2  # tried in the order w0, w1, w2
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            assert charged(c) == {"w0": 1, "w1": 1, "w2": 0}
    run(go())


def test_a_failure_once_is_charged_when_another_worker_serves(run: Callable[..., Any]) -> None:
    """A 500 from one worker, then the request served by another: the first is charged."""
    async def go() -> None:
        workers = [FakeWorker(poison="hello"), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status == 200
            assert charged(c) == {"w0": 1, "w1": 0}
    run(go())


def test_a_stream_cut_twice_goes_on_to_a_third_worker(run: Callable[..., Any]) -> None:
    """A stream cut mid-way (a killed worker), then its continuation cut before its first
    token: no query of death, the third worker finishes it identically."""
    async def go() -> None:
        workers = [FakeWorker(fail_after=5), FakeWorker(fail_after=0), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 1
            c.fleet.balancer.slots["w2"].outstanding = 2
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
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
            c.fleet.balancer.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**POISON, "stream": stream})
            assert resp.status == 400
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
            slot = c.fleet.balancer.slots["w0"]
            slot.breaker = "half_open"
            resp = await c.client.post("/v1/completions", json=BODY)
            assert resp.status == 400
            assert slot.breaker == "closed"
            assert c.fleet.balancer.weight(slot) == 1.0
    run(go())


def test_without_a_retry_budget_a_failed_request_is_not_retried(run: Callable[..., Any]) -> None:
    """retry_budget 0% with no minimum: a worker's 502 ends the request with a 503
    retry_budget_exhausted and Retry-After; the other worker is never asked."""
    async def go() -> None:
        before = counted("ftctl_proxy_retry_budget_exhausted_total")
        workers = [FakeWorker(mode="html502"), FakeWorker()]
        budget = {"budget_percent": 0, "min_retry_concurrency": 0}
        async with Cluster(workers, retry_budget=budget) as c:
            c.fleet.balancer.slots["w1"].outstanding = 1
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status == 503
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
            c.fleet.balancer.slots["w1"].outstanding = 1  # it starts on w0
            resp = await c.client.post("/v1/completions", json=POISON)
            assert resp.status == 200, resp.text
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
            c.fleet.balancer.slots["w1"].outstanding = 5  # both requests start on w0
            body = {**BODY, "stream": False}
            first = asyncio.ensure_future(c.client.post("/v1/completions", json=body))
            await until(lambda: len(workers[1].requests) == 1)  # its retry waits on w1
            second = asyncio.ensure_future(c.client.post("/v1/completions", json=body))
            if status == 503:
                assert (await second).status == 503
            else:
                await until(lambda: len(workers[1].requests) == 2)
            gate.set()
            assert (await first).status == 200
            assert (await second).status == status
    run(go())


# ------------------------------------------------------------------ issue 29: the judgment


async def settled(c: Cluster) -> None:
    """Until no known-good probe of the proxy's is running (charges are confirmed apart)."""
    await until(lambda: not c.fleet._confirming)


def breakers(c: Cluster) -> dict[str, str]:
    return {name: slot.breaker for name, slot in c.fleet.balancer.slots.items()}


def test_a_burst_of_poison_opens_no_breaker(run: Callable[..., Any]) -> None:
    """Issue 29 case 1: 30 poison requests at once spend the retry budget; the suspects left
    unresolved answer the known-good probe, so no breaker opens and healthy requests are
    served at once."""
    async def go() -> None:
        workers = [FakeWorker(poison="POISON"), FakeWorker(poison="POISON")]
        async with Cluster(workers) as c:
            answers = await asyncio.gather(*(c.client.post("/v1/completions", json=POISON)
                                             for _ in range(30)))
            assert {r.status for r in answers} <= {502, 503}
            await settled(c)
            assert breakers(c) == {"w0": "closed", "w1": "closed"}
            for _ in range(4):
                resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
                assert resp.status == 200
    run(go())


def test_poison_on_a_one_worker_fleet_leaves_it_up(run: Callable[..., Any]) -> None:
    """Issue 29 case 2: with no second opinion, five poison requests are answered 502 and the
    lone worker, which answers the known-good probe, keeps serving."""
    async def go() -> None:
        async with Cluster([FakeWorker(poison="POISON")]) as c:
            for _ in range(5):
                resp = await c.client.post("/v1/completions", json=POISON)
                assert resp.status == 502
            await settled(c)
            assert breakers(c) == {"w0": "closed"}
            assert c.fleet.balancer.slots["w0"].charges == 5
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status == 200
    run(go())


def test_a_broken_lone_worker_still_opens_its_breaker(run: Callable[..., Any]) -> None:
    """The other side: a lone worker that fails the known-good probe too is taken out."""
    async def go() -> None:
        async with Cluster([FakeWorker(poison="POISON", sick=True)], breaker_threshold=1) as c:
            resp = await c.client.post("/v1/completions", json=POISON)
            assert resp.status == 502
            await until(lambda: breakers(c) == {"w0": "open"})
    run(go())


async def victims_on(c: Cluster, worker: FakeWorker, seeds: list[int]) -> list[Any]:
    """Streams of BODY (one per seed) paused mid-way on `worker`: their tasks."""
    tasks = [asyncio.ensure_future(c.stream("/v1/completions", {**BODY, "seed": seed}))
             for seed in seeds]
    await until(lambda: worker.paused >= len(seeds))
    return tasks


def test_a_request_that_ends_its_batch_is_held_then_refused(run: Callable[..., Any]) -> None:
    """Issue 29 case 3: a request that ends every stream batched with it: its victims go on
    token-identical elsewhere, it is not taken to another worker's batch (422), no breaker
    opens; a copy that kills a batch again is convicted, and later copies are refused
    without reaching any worker."""
    async def go() -> None:
        workers = [FakeWorker(poison="POISON", poison_answer="killbatch", hold_at=3),
                   FakeWorker(poison="POISON", poison_answer="killbatch")]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 10  # new requests go to w0
            for attempt in range(2):
                workers[0].paused = 0
                workers[0].resume.clear()
                tasks = await victims_on(c, workers[0], [1, 2, 3])
                resp = await c.client.post("/v1/completions", json=POISON)
                assert resp.status == 422, (attempt, resp.text)
                assert resp.json()["error"]["type"] == "query_of_death"
                for seed, (answer, events) in zip([1, 2, 3], await asyncio.gather(*tasks),
                                                  strict=True):
                    assert answer.status == 200
                    assert stream_text(events) == expected_text("hello world", seed, 20)
                    assert all("error" not in e for e in events if isinstance(e, dict))
            assert not [r for r in workers[1].requests if "POISON" in json.dumps(r)]
            assert c.proxy.policy.memory.convicted(fingerprint(POISON))
            seen = len(workers[0].requests)
            resp = await c.client.post("/v1/completions", json=POISON)
            assert resp.status == 422
            assert len(workers[0].requests) == seen
            await settled(c)
            assert breakers(c) == {"w0": "closed", "w1": "closed"}
    run(go())


async def served_past_w0(c: Cluster, count: int) -> None:
    """`count` requests, each tried on w0 first while it has a request to serve, all 200."""
    c.fleet.balancer.slots["w1"].outstanding = 5
    for _ in range(count):
        resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
        assert resp.status == 200


def test_backpressure_goes_elsewhere_and_charges_nobody(run: Callable[..., Any]) -> None:
    """Issue 29 case 4: a worker answering 429 with Retry-After: 30 is spared that long and
    the request is served by another; no breaker moves, nothing is charged."""
    async def go() -> None:
        workers = [FakeWorker(mode="busy429"), FakeWorker()]
        async with Cluster(workers) as c:
            await served_past_w0(c, 3)
            assert len(workers[0].requests) == 1  # spared after its first 429
            w0 = c.fleet.balancer.slots["w0"]
            assert c.fleet.balancer.weight(w0) == 0
            assert w0.spared_until - c.fleet.clock.now() > 25
            assert (w0.charges, w0.breaker) == (0, "closed")
    run(go())


def test_backpressure_in_mid_stream_moves_the_stream_and_charges_nobody(
        run: Callable[..., Any]) -> None:
    """A 429 error event after the first tokens: the stream goes on elsewhere, identical,
    and the full worker is spared, not charged."""
    async def go() -> None:
        workers = [FakeWorker(mode="event429", fail_after=4), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 5
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert stream_text(events) == expected_text("hello world", 5, 20)
            w0 = c.fleet.balancer.slots["w0"]
            assert w0.charges == 0
            assert w0.spared_until > c.fleet.clock.now()
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_backpressure_with_no_other_worker_reaches_the_client(run: Callable[..., Any],
                                                              stream: bool) -> None:
    """Issue 29 case 4, one worker: the client gets 429 with the worker's Retry-After, not
    a 502 without one, and the breaker stays closed."""
    async def go() -> None:
        async with Cluster([FakeWorker(mode="busy429")]) as c:
            for _ in range(4):
                if stream:
                    resp, _ = await c.stream("/v1/completions", BODY)
                else:
                    resp = await c.client.post("/v1/completions",
                                               json={**BODY, "stream": False})
                assert resp.status == 429
                assert 25 <= int(resp.headers["retry-after"]) <= 30
            assert breakers(c) == {"w0": "closed"}
            assert c.fleet.balancer.slots["w0"].charges == 0
    run(go())


def test_a_frontend_without_the_model_is_out_until_it_has_it_again(
        run: Callable[..., Any]) -> None:
    """Issue 29 case 5: an empty 404 (a Dynamo frontend whose workers' lease expired) is not
    the client's error: the request goes to the other frontend, the empty one is out of
    routing with its breaker closed, and back once the known-good probe passes."""
    async def go() -> None:
        workers = [FakeWorker(mode="empty404"), FakeWorker()]
        async with Cluster(workers) as c:
            await served_past_w0(c, 4)
            w0 = c.fleet.balancer.slots["w0"]
            assert w0.absent
            assert w0.breaker == "closed"
            assert w0.charges == 0
            assert len(workers[0].requests) == 1
            workers[0].mode = "ok"  # its workers are back
            await until(lambda: not w0.absent)
            resp = await c.client.post("/v1/completions", json={**BODY, "stream": False})
            assert resp.status == 200
            assert len(workers[0].requests) == 2
    run(go())


def test_a_client_cannot_take_another_clients_upstream_id(run: Callable[..., Any]) -> None:
    """Issue 29 case 6: two clients sending the same X-Request-Id (or the proxy's next one)
    both get served by a worker that refuses a running id (409): each attempt has its own."""
    async def go() -> None:
        worker = FakeWorker(unique_ids=True, hold_at=2)
        async with Cluster([worker]) as c:
            first = asyncio.ensure_future(c.stream("/v1/completions", BODY,
                                                   headers={"X-Request-Id": "same"}))
            await until(lambda: worker.paused == 1)
            second = asyncio.ensure_future(c.stream("/v1/completions", BODY,
                                                    headers={"X-Request-Id": "same"}))
            await until(lambda: worker.paused == 2)
            worker.resume.set()
            for resp, events in await asyncio.gather(first, second):
                assert resp.status == 200
                assert resp.headers["x-request-id"] == "same"
                assert stream_text(events) == expected_text("hello world", 5, 20)
    run(go())


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(["ok", "ok", "busy429", "sick"]), min_size=1,
                      max_size=5),
       requests=st.lists(st.sampled_from(["healthy", "poison", "poison"]), min_size=1,
                         max_size=16),
       budget=st.sampled_from([0, 20, 100]))
def test_no_interleaving_opens_a_breaker_on_a_worker_that_answers_the_probe(
        run: Callable[..., Any], kinds: list[str], requests: list[str], budget: int) -> None:
    """Any mix of concurrent poison and healthy requests over 1-5 workers, some full (429),
    some broken (failing the known-good probe too): no breaker ever opens on a worker that
    answers the probe, and one opens on every broken worker a request reached."""
    async def go() -> None:
        workers = [FakeWorker(mode="html502" if kind == "sick" else kind, poison="POISON")
                   for kind in kinds]
        async with Cluster(workers, breaker_threshold=1,
                           retry_budget={"budget_percent": budget,
                                         "min_retry_concurrency": 1}) as c:
            answers = await asyncio.gather(*(
                c.client.post("/v1/completions",
                              json=POISON if r == "poison" else {**BODY, "stream": False})
                for r in requests))
            await settled(c)
            for (name, slot), kind, worker in zip(c.fleet.balancer.slots.items(), kinds, workers,
                                                  strict=True):
                if kind == "sick":
                    if worker.requests:
                        assert slot.breaker == "open", name
                else:
                    assert slot.failures == 0, name
                    assert slot.breaker == "closed", name
            healthy_ok = "ok" in kinds
            for r, resp in zip(requests, answers, strict=True):
                if r == "healthy" and healthy_ok:
                    assert resp.status in (200, 503), resp.text
    run(go())


@pytest.mark.parametrize("first", ["reset", "http500", "http429"])
def test_a_stream_cut_after_a_retry_goes_on_from_token_ids(run: Callable[..., Any],
                                                           first: str) -> None:
    """Issue 29's promise: a request retried before its first token (the first worker was
    gone, failed or full), then cut mid-way, goes on from prompt ids + generated ids, not
    from re-sent text (the prompt's ids were only taken from the first attempt, so a
    subword tokenizer continued from other ids)."""
    async def go() -> None:
        workers = [FakeWorker(poison="hello", poison_answer=first),
                   FakeWorker(fail_after=5), FakeWorker()]
        async with Cluster(workers) as c:
            c.fleet.balancer.slots["w1"].outstanding = 1
            c.fleet.balancer.slots["w2"].outstanding = 2  # tried in the order w0, w1, w2
            resp, events = await c.stream("/v1/completions", BODY)
            assert resp.status == 200
            assert "x-ftctl-continuation" not in resp.headers
            assert stream_text(events) == expected_text("hello world", 5, 20)
            prompt = workers[2].requests[-1]["prompt"]
            assert prompt == [*b"hello world", *(ord(ch) for ch in
                                                 expected_text("hello world", 5, 5))]
    run(go())


def test_confirm_never_spins_on_a_probe_that_ended_but_is_still_registered(
        run: Callable[..., Any]) -> None:
    """A probe that has ended stays registered until its done callback runs, a loop turn
    later; a `confirm` arriving in between must start a fresh probe, not await the ended
    one in a loop that never yields (that froze the whole proxy under load: CI, and
    py-spy on the hung process, stack Fleet._verify -> Fleet.confirm -> shield)."""
    from dynamo_ftctl.proxy import fleet as fleet_module

    async def go() -> None:
        async with Cluster([FakeWorker(), FakeWorker()]) as c:
            fleet = c.fleet
            slot = fleet.balancer.slots["w0"]
            ended: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            ended.set_result("an old verdict")
            fleet._confirming[slot.name] = fleet_module._Probe(
                next(fleet._probe_seq), ended)
            async with asyncio.timeout(10):  # the loop would spin: the timeout never fires
                verdict = await asyncio.wait_for(fleet.confirm(slot), 10)
            assert verdict is None  # a fresh probe of a healthy worker
    run(go())
