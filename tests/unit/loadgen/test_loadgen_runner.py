"""The runner on a fake clock and a fake sender: planning, caps, abort, closed loop, events."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.loadgen.config import LoadConfig, Schedule
from dynamo_ftctl.loadgen.record import RequestRecord
from dynamo_ftctl.loadgen.runner import LoadEvent, run_load_async
from dynamo_ftctl.loadgen.workload import RequestSpec


class FakeSender:
    """Answers at once (fake time does not move) with a scripted outcome per request."""

    def __init__(self, clock: FakeClock, outcomes: tuple[str, ...] = ("ok",)) -> None:
        self.clock = clock
        self.outcomes = outcomes
        self.specs: list[RequestSpec] = []
        self.gate: asyncio.Event | None = None
        self.in_flight = 0
        self.max_in_flight = 0

    async def send(self, spec: RequestSpec, planned: float, *, warmup: bool,
                   t0: float) -> RequestRecord:
        self.specs.append(spec)
        sent = self.clock.now() - t0
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
        outcome = self.outcomes[spec.index % len(self.outcomes)]
        done = self.clock.now() - t0
        return RequestRecord(index=spec.index, target=spec.target, planned=planned, sent=sent,
                             done=done, first_token=done if outcome == "ok" else None,
                             output_tokens=1, itl=(), status=200, outcome=outcome,
                             warmup=warmup)


def _run(config: LoadConfig, sender: FakeSender, clock: FakeClock, **kw):
    return asyncio.run(run_load_async(config, clock=clock, sender=sender, **kw))


def test_open_loop_sends_at_the_planned_times():
    """On a fake clock each request leaves exactly at its planned offset."""
    clock = FakeClock()
    sender = FakeSender(clock)
    config = LoadConfig(targets=("http://a", "http://b"),
                        schedule=Schedule(rate=10, arrival="constant"), duration_s=1.0)
    report = _run(config, sender, clock)
    assert [r.planned for r in report.records] == pytest.approx([i / 10 for i in range(10)])
    assert all(r.queue_s == pytest.approx(0) for r in report.records)
    assert [s.target for s in sender.specs[:4]] == ["http://a", "http://b"] * 2
    assert report.summary.planned_requests == 10


def test_warmup_requests_are_sent_but_not_counted():
    """Requests planned in the warm-up are sent and marked, and left out of the summary."""
    clock = FakeClock()
    sender = FakeSender(clock)
    config = LoadConfig(targets=("http://a",), schedule=Schedule(rate=10, arrival="constant"),
                        duration_s=2.0, warmup_s=0.5)
    report = _run(config, sender, clock)
    assert len(sender.specs) == 20
    assert sum(r.warmup for r in report.records) == 5
    assert report.summary.completed == 15
    assert report.summary.planned_requests == 15


def test_abort_stops_sending_when_errors_pass_the_limit():
    """With every request failing, the run stops after the minimum sample, not at its end."""
    clock = FakeClock()
    sender = FakeSender(clock, outcomes=("5xx_500",))
    events: list[LoadEvent] = []
    config = LoadConfig(targets=("http://a",), schedule=Schedule(rate=100), requests=1000,
                        abort_error_rate=0.5, abort_min_requests=10)
    report = _run(config, sender, clock, on_event=events.append)
    assert report.aborted is not None
    assert "error rate" in report.aborted
    assert len(sender.specs) < 30
    kinds = [e.kind for e in events]
    assert kinds[0] == "started"
    assert "aborted" in kinds
    assert kinds[-1] == "finished"


def test_closed_loop_runs_the_count_with_n_users():
    """Closed loop with 3 users sends exactly the requested count, never more than 3 at once."""
    clock = FakeClock()
    sender = FakeSender(clock)
    config = LoadConfig(targets=("http://a",), schedule=Schedule(users=3), requests=25)
    report = _run(config, sender, clock)
    assert len(report.records) == 25
    assert sorted(r.index for r in report.records) == list(range(25))
    assert sender.max_in_flight <= 3


def test_concurrency_cap_limits_requests_in_flight():
    """An open-loop cap of 2 keeps at most 2 requests in flight while the server is stuck."""
    clock = FakeClock()
    sender = FakeSender(clock)

    async def scenario():
        sender.gate = asyncio.Event()
        config = LoadConfig(targets=("http://a",),
                            schedule=Schedule(rate=100, arrival="constant", concurrency=2),
                            requests=10)
        task = asyncio.create_task(run_load_async(config, clock=clock, sender=sender))
        for _ in range(200):
            await asyncio.sleep(0)
        assert sender.in_flight == 2
        sender.gate.set()
        return await task

    report = asyncio.run(scenario())
    assert sender.max_in_flight == 2
    assert len(report.records) == 10


def test_markers_are_kept_in_the_report():
    """Fault markers appended by a drill during the run end up in the report, sorted."""
    clock = FakeClock()
    sender = FakeSender(clock)
    markers: list[tuple[float, str]] = [(0.5, "kill w1")]
    config = LoadConfig(targets=("http://a",), schedule=Schedule(rate=10), requests=3)

    def on_event(event: LoadEvent) -> None:
        if event.kind == "started":
            markers.append((0.1, "xid48 w2"))

    report = _run(config, sender, clock, on_event=on_event, markers=markers)
    assert report.markers == ((0.1, "xid48 w2"), (0.5, "kill w1"))
    assert report.to_json()["markers"][0] == {"t_s": 0.1, "label": "xid48 w2"}


def test_spin_and_client_are_checked_and_described():
    """A negative or over-long spin, an unknown client and the removed aiohttp one are
    refused; both are described."""
    from dynamo_ftctl.errors import InvalidInput
    from dynamo_ftctl.loadgen.runner import describe_config

    base = {"targets": ("http://a",), "schedule": Schedule(rate=10), "requests": 3}
    for bad in ({"spin_s": -0.001}, {"spin_s": 2.0}, {"client": "h3"}, {"client": "aiohttp"}):
        with pytest.raises(InvalidInput):
            LoadConfig(**base, **bad)
    doc = describe_config(LoadConfig(**base, spin_s=0.0025, client="http1"))
    assert (doc["spin_us"], doc["client"]) == (2500, "http1")


class SheddingSender(FakeSender):
    """Sheds the requests whose index is in `shed` with that Retry-After (None: no header);
    notes which user (task) sent each request, and when it was sent and answered."""

    def __init__(self, clock: FakeClock, shed: dict[int, float | None],
                 took_s: float = 0.01) -> None:
        super().__init__(clock)
        self.shed = shed
        self.took_s = took_s
        self.by_user: dict[int, list[tuple[float, float, float | None]]] = {}

    async def send(self, spec: RequestSpec, planned: float, *, warmup: bool,
                   t0: float) -> RequestRecord:
        sent = self.clock.now() - t0
        await self.clock.asleep(self.took_s)
        done = self.clock.now() - t0
        user = id(asyncio.current_task())
        if spec.index not in self.shed:
            self.by_user.setdefault(user, []).append((sent, done, None))
            return RequestRecord(index=spec.index, target=spec.target, planned=planned,
                                 sent=sent, done=done, first_token=done, output_tokens=1,
                                 itl=(), status=200, outcome="ok", warmup=warmup)
        wait = self.shed[spec.index]
        self.by_user.setdefault(user, []).append((sent, done, wait))
        return RequestRecord(index=spec.index, target=spec.target, planned=planned, sent=sent,
                             done=done, first_token=None, output_tokens=0, itl=(),
                             status=503, outcome="5xx_503", warmup=warmup, retry_after_s=wait)


@settings(max_examples=60, deadline=None)
@given(users=st.integers(1, 4),
       shed=st.dictionaries(st.integers(0, 39), st.one_of(st.none(), st.sampled_from(
           [0.0, 0.5, 1.0, 3.0])), max_size=30),
       honor=st.booleans())
def test_closed_loop_users_wait_out_retry_after(users: int, shed: dict[int, float | None],
                                                honor: bool) -> None:
    """With honor_retry_after a user sends its next request no sooner than the Retry-After
    of its last shed answer (without it, or without the header, at once); never after the
    run's end."""
    clock = FakeClock()
    sender = SheddingSender(clock, shed)
    config = LoadConfig(targets=("http://a",),
                        schedule=Schedule(users=users, honor_retry_after=honor),
                        requests=40, duration_s=30.0)
    report = _run(config, sender, clock)
    assert len(report.records) == 40
    assert len(sender.by_user) <= users
    for answers in sender.by_user.values():
        for (_, done, wait), (sent_next, _, _) in itertools.pairwise(answers):
            gap = sent_next - done
            if honor and wait:
                assert gap >= wait - 1e-9
            else:
                assert gap == pytest.approx(0, abs=1e-9)
        assert all(sent < 30.0 for sent, _, _ in answers)


def test_a_shed_user_does_not_wait_past_the_run() -> None:
    """A Retry-After longer than what is left of the run ends the user at the run's end,
    not after the wait."""
    clock = FakeClock()
    sender = SheddingSender(clock, {0: 3600.0})
    config = LoadConfig(targets=("http://a",),
                        schedule=Schedule(users=1, honor_retry_after=True), duration_s=5.0)
    started = clock.now()
    report = _run(config, sender, clock)
    assert len(report.records) == 1
    assert clock.now() - started < 10


def test_honor_retry_after_needs_a_closed_loop() -> None:
    """honor_retry_after on an open loop (planned arrivals) is refused, naming the field."""
    with pytest.raises(InvalidInput, match="honor_retry_after: needs a closed loop"):
        Schedule(rate=10, honor_retry_after=True)
