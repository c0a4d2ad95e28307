"""The health daemon with fake workers and a fake clock: rounds, confirmation, reports, API."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from dynamo_ftctl import http1
from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.health.daemon import REPORT_PROBE_GAP_S, HealthDaemon, WatchedWorker, create_app
from dynamo_ftctl.health.probe import ProbeTarget
from dynamo_ftctl.health.state import HealthState, Transition
from dynamo_ftctl.httpserver import Reply, Request
from dynamo_ftctl.inventory.canary import CanaryConfig, TransitionAction
from dynamo_ftctl.jsoncodec import dumps
from dynamo_ftctl.metrics import REGISTRY
from dynamo_ftctl.proxy.balancer import parse_daemon_weights
from tests.waiting import until

from .fakes import SET, AsyncFakeWorkers, corrupt, good, refused

TOKEN = "daemon-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def fleet(prefix: str, count: int) -> list[WatchedWorker]:
    return [WatchedWorker(ProbeTarget(f"{prefix}{i}", f"http://{prefix}{i}", "m"), "node-a", (i,))
            for i in range(count)]


def daemon_for(prefix: str, count: int, fake: AsyncFakeWorkers, clock: FakeClock,
               **config: object) -> tuple[HealthDaemon, list[Transition]]:
    seen: list[Transition] = []
    daemon = HealthDaemon(fleet(prefix, count), SET, CanaryConfig(**config),  # type: ignore[arg-type]
                          clock=clock, transport=fake, on_transition=seen.append)
    return daemon, seen


def status(worker: str, state: str) -> float | None:
    return REGISTRY.get_sample_value("ftctl_worker_state", {"worker": worker, "state": state})


def test_a_round_probes_everyone_and_confirms_failures_at_once() -> None:
    """One round: healthy workers stay, a corrupt one is confirmed to UNHEALTHY in that round."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={"http://ra1": corrupt})
    daemon, seen = daemon_for("ra", 3, fake, clock)
    asyncio.run(daemon.probe_round())
    states = {name: e.health.state for name, e in daemon.entries.items()}
    assert states == {"ra0": HealthState.HEALTHY, "ra1": HealthState.UNHEALTHY,
                      "ra2": HealthState.HEALTHY}
    assert [t.state for t in seen] == [HealthState.SUSPICIOUS, HealthState.UNHEALTHY]
    assert fake.calls.count("http://ra1") == 3 * len(SET.prompts)  # threshold probes
    assert status("ra1", "unhealthy") == 1.0
    assert status("ra1", "healthy") == 0.0
    assert REGISTRY.get_sample_value("ftctl_circuit_breaker_state", {"worker": "ra1"}) == 1.0
    assert REGISTRY.get_sample_value(
        "ftctl_canary_probe_duration_seconds_count", {"worker": "ra0"}) == 1.0


def test_open_breaker_waits_then_one_trial_recovers() -> None:
    """While open no probe goes out; after recovery_s the half-open trial brings it back."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={"http://rb0": corrupt})
    daemon, seen = daemon_for("rb", 1, fake, clock, recovery_s=60.0)
    asyncio.run(daemon.probe_round())
    calls = len(fake.calls)
    asyncio.run(daemon.probe_round())
    assert len(fake.calls) == calls  # breaker open: nothing sent
    fake.behaviour["http://rb0"] = good
    clock.advance(60)
    asyncio.run(daemon.probe_round())
    assert daemon.entries["rb0"].health.state is HealthState.HEALTHY
    assert seen[-1].reason.startswith("half-open trial passed")


def test_passive_report_reaches_unhealthy_without_waiting_for_a_round() -> None:
    """A proxy report on a dead worker: SUSPICIOUS at once, confirmed UNHEALTHY by fast probes."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={"http://rc0": refused})
    daemon, seen = daemon_for("rc", 2, fake, clock)

    async def go() -> None:
        outcome = daemon.report({"worker": "rc0", "ok": False, "reason": "stream broke",
                                 "source": "proxy"})
        assert outcome.states == {"rc0": "suspicious"}
        await daemon.settle()

    asyncio.run(go())
    assert daemon.entries["rc0"].health.state is HealthState.UNHEALTHY
    assert seen[0].source == "proxy"
    assert daemon.rounds == 0
    assert "http://rc1" not in fake.calls


def test_gpu_event_maps_to_the_workers_on_that_gpu() -> None:
    """A GPU watcher event names node and gpu; the worker using that GPU gets the failure."""
    clock = FakeClock()
    daemon, _ = daemon_for("rd", 3, AsyncFakeWorkers(clock), clock)

    async def go() -> None:
        outcome = daemon.report({"source": "gpu", "node": "node-a", "gpu": 2, "xid": 48,
                                 "reason": "xid 48: DBE"})
        assert outcome.workers == ("rd2",)
        assert daemon.entries["rd2"].health.state is HealthState.SUSPICIOUS
        ignored = daemon.report({"source": "gpu", "workers": ["rd1"], "actionable": False})
        assert not ignored.accepted
        await daemon.settle()  # the confirmation probe finds rd2 fine again

    asyncio.run(go())
    assert daemon.entries["rd2"].health.state is HealthState.HEALTHY
    assert daemon.entries["rd1"].health.state is HealthState.HEALTHY


@pytest.mark.parametrize("body", [
    {"worker": "nobody", "ok": False},
    {"ok": False},
    {"worker": "re0", "ok": "no"},
    {"worker": "re0", "source": "alien"},
])
def test_bad_reports_are_invalid_input(body: dict[str, object]) -> None:
    """Unknown workers, missing targets and wrong types are refused with a reason."""
    clock = FakeClock()
    daemon, _ = daemon_for("re", 1, AsyncFakeWorkers(clock), clock)
    with pytest.raises(InvalidInput):
        daemon.report(body)


def test_concurrency_is_bounded() -> None:
    """With concurrency 4, never more than 4 probes are in flight, and 4 are reached."""
    clock = FakeClock()
    in_flight = 0
    peak = 0

    class Slow(AsyncFakeWorkers):
        async def handle_async_request(self, request: http1.Request) -> http1.Reply:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            in_flight -= 1
            return good(json.loads(request.body)["prompt"])

    daemon, _ = daemon_for("rf", 20, Slow(clock), clock, concurrency=4)
    asyncio.run(daemon.probe_round())
    assert peak == 4 * len(SET.prompts)  # each probe sends its set's prompts at once
    assert daemon.probes == 20
    peak = 0
    daemon, _ = daemon_for("rs", 20, Slow(clock), clock, concurrency=4, parallel_prompts=False)
    asyncio.run(daemon.probe_round())
    assert peak == 4


def test_http_api_serves_weights_the_proxy_understands() -> None:
    """GET /workers gives states and weights that the proxy's parser reads; /report works."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={"http://rg1": corrupt})
    daemon, _ = daemon_for("rg", 2, fake, clock)

    async def go() -> None:
        await daemon.probe_round()
        async with api(daemon, headers=AUTH) as client:
            doc = (await client.get("/workers")).json()
            assert parse_daemon_weights(doc) == {"rg0": 1.0, "rg1": 0.0}
            assert doc["workers"][1]["last"]["kind"] == "token_mismatch"
            bad = await client.post("/report", content=b"{nope")
            assert bad.status == 400
            unknown = await client.post("/report", json={"worker": "zz"})
            assert unknown.status == 400
            assert "unknown worker" in unknown.json()["error"]
            ok = await client.post("/report", json={"worker": "rg0", "ok": False})
            assert ok.json()["states"] == {"rg0": "suspicious"}
            metrics = (await client.get("/metrics")).text
            assert 'ftctl_worker_state{state="unhealthy",worker="rg1"} 1.0' in metrics
            assert (await client.get("/health")).json()["status"] == "ok"
        await daemon.settle()

    asyncio.run(go())


def acting_daemon(prefix: str, action: TransitionAction) -> tuple[HealthDaemon, list[Any]]:
    """A daemon over one worker that refuses every probe (so it goes UNHEALTHY), running
    `action`, and the list its action outcomes are reported to."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={f"http://{prefix}0": refused})
    outcomes: list[Any] = []
    daemon = HealthDaemon(fleet(prefix, 1), SET, CanaryConfig(actions=(action,)), clock=clock,
                          transport=fake, on_action=outcomes.append)
    # The fake transport has no client session: give the daemon a stand-in for actions.
    fake.session = object()  # type: ignore[attr-defined]
    return daemon, outcomes


def test_command_action_sees_worker_and_state(tmp_path: Path) -> None:
    """A command action runs on entering UNHEALTHY with FTCTL_WORKER/FTCTL_STATE set."""
    out = tmp_path / "action.txt"
    script = ("import os, pathlib; pathlib.Path(os.environ['OUT']).write_text("
              "os.environ['FTCTL_WORKER'] + ' ' + os.environ['FTCTL_STATE'] + ' ' + "
              "os.environ['FTCTL_PREVIOUS_STATE'])")
    action = TransitionAction(on=("unhealthy",), command=(sys.executable, "-c", script))
    daemon, outcomes = acting_daemon("rh", action)

    async def go() -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OUT", str(out))
            await daemon.probe_round()

    asyncio.run(go())
    assert out.read_text() == "rh0 unhealthy suspicious"
    assert len(outcomes) == 1


def test_an_action_in_flight_at_shutdown_runs_to_its_end_and_is_reported(tmp_path: Path) -> None:
    """`aclose` (SIGTERM) cancels probes but not a transition action under way: the drain
    that was started finishes (within its timeout) and its outcome is reported."""
    started, go = tmp_path / "started", tmp_path / "go"
    script = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); "
              "end = time.monotonic() + 30\n"
              "while not pathlib.Path(sys.argv[2]).exists() and time.monotonic() < end: "
              "time.sleep(0.01)\n"
              "sys.exit(0 if pathlib.Path(sys.argv[2]).exists() else 1)")
    action = TransitionAction(on=("unhealthy",), timeout_s=60,
                              command=(sys.executable, "-c", script, str(started), str(go)))
    daemon, outcomes = acting_daemon("rt", action)

    async def go_() -> None:
        daemon.start_round()
        await until(started.exists, 30, "the action to start")
        closing = asyncio.ensure_future(daemon.aclose())
        await asyncio.sleep(0)  # aclose has cancelled what it cancels and now waits
        assert not closing.done()
        go.touch()
        await asyncio.wait_for(closing, 30)

    asyncio.run(go_())
    assert [(o.worker, o.state, o.ok, o.detail) for o in outcomes] == \
        [("rt0", "unhealthy", True, "exit 0")]


# ---------------------------------------------------------------------- reports under attack


class _Api:
    """The daemon's routes called from `client`'s address with no socket: the router gets
    the `httpserver.Request` the server would have parsed; answers are `http1.Reply`s."""

    def __init__(self, daemon: HealthDaemon, token: str | None, client: tuple[str, int],
                 headers: dict[str, str] | None) -> None:
        self.router = create_app(daemon, token=token)
        self.client = client
        self.headers = dict(headers or {})

    async def request(self, method: str, path: str, *, json: Any = None, content: bytes = b"",
                      headers: dict[str, str] | None = None,
                      params: dict[str, str] | None = None) -> http1.Reply:
        body = content if json is None else dumps(json)
        sent = {**self.headers, **(headers or {})}
        parsed = Request(method=method, path=path, query=urlencode(params or {}),
                         headers=[(k.lower().encode(), v.encode()) for k, v in sent.items()],
                         body=body, client=self.client)
        reply = await self.router(parsed)
        assert isinstance(reply, Reply)
        answer = {"content-type": reply.content_type}
        answer.update((k.lower(), v) for k, v in reply.headers.items())
        return http1.Reply(reply.status, reply.body, answer)

    async def get(self, path: str, **kwargs: Any) -> http1.Reply:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> http1.Reply:
        return await self.request("POST", path, **kwargs)

    async def __aenter__(self) -> _Api:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def api(daemon: HealthDaemon, *, token: str | None = TOKEN,
        client: tuple[str, int] = ("10.0.0.1", 40000),
        headers: dict[str, str] | None = None) -> _Api:
    """A client for the daemon's routes, coming from `client`'s address."""
    return _Api(daemon, token, client, headers)


FORGED = {"worker": "ta0", "ok": False, "reason": "forged"}


@pytest.mark.parametrize(("headers", "params"), [
    ({}, {}),
    ({"Authorization": "Bearer wrong"}, {}),
    ({"Authorization": TOKEN}, {}),
    ({"Authorization": f"Token {TOKEN}"}, {}),
    ({"X-Auth-Token": TOKEN}, {}),
    ({"Cookie": f"token={TOKEN}"}, {}),
    ({}, {"token": TOKEN}),
    ({}, {"access_token": TOKEN}),
])
def test_forged_reports_without_the_token_change_nothing(
        headers: dict[str, str], params: dict[str, str]) -> None:
    """Five failure reports without the token in the Authorization header: 401, still HEALTHY."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock)
    daemon, seen = daemon_for("ta", 1, fake, clock)

    async def go() -> list[int]:
        async with api(daemon) as client:
            codes = [(await client.post("/report", json=FORGED, headers=headers,
                                        params=params)).status for _ in range(5)]
        await daemon.settle()
        return codes

    codes = asyncio.run(go())
    assert codes == [401] * 5
    assert daemon.entries["ta0"].health.state is HealthState.HEALTHY
    assert daemon.entries["ta0"].health.consecutive_failures == 0
    assert seen == []
    assert fake.calls == []  # not even an early probe


def test_reports_are_refused_with_403_while_the_daemon_has_no_token() -> None:
    """No token configured: every report is refused, whatever it sends; GETs still answer."""
    clock = FakeClock()
    daemon, _ = daemon_for("tb", 1, AsyncFakeWorkers(clock), clock)

    async def go() -> None:
        async with api(daemon, token=None) as client:
            refused = await client.post("/report", json={**FORGED, "worker": "tb0"},
                                        headers={"Authorization": "Bearer "})
            assert refused.status == 403
            assert "FTCTL_DAEMON_TOKEN is not set" in refused.json()["error"]
            assert (await client.get("/workers")).status == 200

    asyncio.run(go())
    assert daemon.entries["tb0"].health.state is HealthState.HEALTHY


def test_a_lowercase_bearer_report_is_taken() -> None:
    """`authorization: bearer TOKEN` counts: the scheme is case-insensitive (RFC 7235)."""
    clock = FakeClock()
    daemon, _ = daemon_for("tc", 1, AsyncFakeWorkers(clock), clock)

    async def go() -> http1.Reply:
        async with api(daemon) as client:
            response = await client.post("/report", json={**FORGED, "worker": "tc0"},
                                         headers={"authorization": f"bearer {TOKEN}"})
        await daemon.settle()
        return response

    assert asyncio.run(go()).json()["states"] == {"tc0": "suspicious"}


def test_reports_beyond_the_burst_get_429_per_source() -> None:
    """A source past report_burst gets 429 + Retry-After; another source and time bring room."""
    clock = FakeClock()
    daemon, _ = daemon_for("td", 1, AsyncFakeWorkers(clock), clock, failure_threshold=100,
                           report_burst=3, report_rate_per_s=0.5)

    async def go() -> None:
        body = {**FORGED, "worker": "td0"}
        async with api(daemon) as one, api(daemon, client=("10.0.0.2", 1)) as two:
            codes = [(await one.post("/report", json=body, headers=AUTH)).status
                     for _ in range(4)]
            assert codes == [200, 200, 200, 429]
            limited = await one.post("/report", json=body, headers=AUTH)
            assert limited.status == 429
            assert limited.header("Retry-After") == "2"
            assert (await two.post("/report", json=body, headers=AUTH)).status == 200
            clock.advance(2.0)
            assert (await one.post("/report", json=body, headers=AUTH)).status == 200
        await daemon.settle()

    asyncio.run(go())
    assert daemon.entries["td0"].health.consecutive_failures <= 5


def test_ok_reports_never_restore_a_worker() -> None:
    """`ok: true` (proxy or GPU) leaves a SUSPICIOUS worker suspicious; a passing probe restores."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock)
    daemon, seen = daemon_for("te", 1, fake, clock)
    health = daemon.entries["te0"].health
    health.record(False, "canary: token mismatch", "probe")

    async def go() -> None:
        for source in ("proxy", "gpu"):
            outcome = daemon.report({"worker": "te0", "ok": True, "source": source})
            assert not outcome.accepted
            assert "only a passing canary probe" in outcome.detail
            assert outcome.states == {"te0": "suspicious"}
        async with api(daemon) as client:
            answer = await client.post("/report", json={"worker": "te0", "ok": True},
                                       headers=AUTH)
            assert answer.json()["states"] == {"te0": "suspicious"}
        assert (health.state, health.consecutive_failures) == (HealthState.SUSPICIOUS, 1)
        assert fake.calls == []  # an ok report asks for no probe either
        await daemon.probe_round()

    asyncio.run(go())
    assert health.state is HealthState.HEALTHY
    assert seen[-1].source == "probe"


def test_ok_reports_cannot_hold_up_a_corrupt_worker_or_storm_it_with_probes() -> None:
    """Under a stream of `ok: true` reports an SDC worker still reaches UNHEALTHY in
    failure_threshold probes (issue 22: it stayed HEALTHY at ~95 probes a second)."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={"http://tf0": corrupt})
    daemon, _ = daemon_for("tf", 1, fake, clock, failure_threshold=3)

    async def go() -> None:
        daemon.start_round()
        for _ in range(200):  # 2 s of reports, one every 10 ms
            daemon.report({"worker": "tf0", "ok": True, "source": "proxy"})
            await asyncio.sleep(0)
            clock.advance(0.01)
        await daemon.settle()

    asyncio.run(go())
    assert daemon.entries["tf0"].health.state is HealthState.UNHEALTHY
    assert daemon.probes == 3


def test_a_stream_of_failure_reports_probes_at_most_once_a_second() -> None:
    """Forty failure reports in 2 s on a healthy worker: at most one early probe per second."""
    clock = FakeClock()
    fake = AsyncFakeWorkers(clock)
    daemon, _ = daemon_for("tg", 1, fake, clock, failure_threshold=100)

    async def go() -> None:
        for _ in range(40):  # one every 50 ms
            daemon.report({"worker": "tg0", "ok": False, "reason": "stream broke"})
            for _ in range(5):
                await asyncio.sleep(0)
            clock.advance(0.05)
        await daemon.settle()

    asyncio.run(go())
    window_s = 40 * 0.05 + 40 * 2 * 0.01  # the reports' spacing plus the fake probes' own time
    assert 1 <= daemon.probes <= int(window_s / REPORT_PROBE_GAP_S) + 1
    assert daemon.entries["tg0"].health.state is not HealthState.UNHEALTHY
