"""The hypothesis: state probes ask real loopback servers until their deadline; metric and
drained probes judge the measures against their tolerance."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

from dynamo_ftctl.clock import SYSTEM_CLOCK
from dynamo_ftctl.drill.hypothesis import check_probe, detections, judge_drained, judge_metric
from dynamo_ftctl.drill.scenario import Probe, load_scenario
from dynamo_ftctl.drill.state import DrillRun
from dynamo_ftctl.proxy.admission import BUSY_BODY
from tests.loopback import Server

# The probes under test are built in each test; the scenario only has to load.
SCENARIO = """title: probes
inventory: inv.yaml
hypothesis: {probes: [{name: up, kind: workers_healthy}]}
method: {timeline: [{at_s: 0, probe: {name: up, kind: workers_healthy}}]}
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run(tmp_path: Path, w1: str, w2: str) -> DrillRun:
    (tmp_path / "inv.yaml").write_text(f"""cluster: t
workers:
  - {{name: w1, url: "{w1}", model: m, faults: [kill]}}
  - {{name: w2, url: "{w2}", model: m, faults: [kill]}}
""")
    (tmp_path / "s.yaml").write_text(SCENARIO)
    scenario, inventory = load_scenario(tmp_path / "s.yaml")
    return DrillRun(scenario=scenario, inventory=inventory, out_dir=tmp_path,
                    clock=SYSTEM_CLOCK, env={}, target_url=w1)


def _answers(status: str, headers: str = "", body: bytes = b"ok"):  # type: ignore[no-untyped-def]
    """A keep-alive server handler answering every request with `status` and `body`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _: int) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(f"HTTP/1.1 {status}\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            await writer.drain()

    return handler


def test_workers_healthy_passes_when_all_answer_200(tmp_path: Path) -> None:
    """Every worker answering /health 200 passes at once, naming them."""

    async def main() -> None:
        async with Server(_answers("200 OK")) as one, Server(_answers("200 OK")) as two:
            run = _run(tmp_path, one.url, two.url)
            outcome = await check_probe(run, Probe(name="up", kind="workers_healthy"), "before")
            assert outcome.passed, outcome.detail
            assert outcome.detail == "all of w1, w2 answer /health 200"

    asyncio.run(main())


def test_workers_healthy_fails_at_its_deadline_naming_the_down_worker(tmp_path: Path) -> None:
    """A worker refusing connections fails the probe once `within_s` has passed."""

    async def main() -> None:
        async with Server(_answers("200 OK")) as one:
            run = _run(tmp_path, one.url, f"http://127.0.0.1:{_closed_port()}")
            probe = Probe(name="up", kind="workers_healthy", within_s=0.3)
            started = asyncio.get_running_loop().time()
            outcome = await check_probe(run, probe, "after", 1.5)
            assert asyncio.get_running_loop().time() - started < 5
            assert not outcome.passed
            assert outcome.detail == "not healthy within 0.3 s: w2"
            assert (outcome.phase, outcome.t_s) == ("after", 1.5)

    asyncio.run(main())


def test_shed_probe_passes_on_503_with_retry_after_and_the_busy_body(tmp_path: Path) -> None:
    """The proxy's 503 with Retry-After and exactly the busy body is a proper shed."""
    body = json.dumps({**BUSY_BODY, "code": 503}).encode()

    async def main() -> None:
        async with Server(_answers("503 Service Unavailable", "Retry-After: 1\r\n",
                                   body)) as proxy:
            run = _run(tmp_path, proxy.url, proxy.url)
            probe = Probe(name="s", kind="shed", priority="best_effort", within_s=2)
            outcome = await check_probe(run, probe, "during", 0.0)
            assert outcome.passed, outcome.detail
            assert "503 with Retry-After: 1" in outcome.detail

    asyncio.run(main())


def test_shed_probe_fails_when_nothing_is_shed(tmp_path: Path) -> None:
    """A proxy that serves every request, or sheds without Retry-After, fails the probe."""

    async def main() -> None:
        async with Server(_answers("200 OK")) as served, \
                Server(_answers("503 Service Unavailable")) as bare:
            probe = Probe(name="s", kind="shed", priority="best_effort", within_s=0.2)
            outcome = await check_probe(_run(tmp_path, served.url, served.url), probe, "during")
            assert not outcome.passed
            assert outcome.detail.endswith("; HTTP 200)")
            outcome = await check_probe(_run(tmp_path, bare.url, bare.url), probe, "during")
            assert "503 with Retry-After None" in outcome.detail

    asyncio.run(main())


def test_metric_probes_judge_tolerances() -> None:
    """≤ tolerances pass at the bound and fail past it; rejected_min needs at least max."""
    counts = {"failed": 0, "error_rate": 0.1, "rejected": 3, "tokens_lost": 0}
    assert judge_metric(Probe(name="f", kind="failed", max=0), counts, None).passed
    assert not judge_metric(Probe(name="e", kind="error_rate", max=0.05), counts, None).passed
    assert judge_metric(Probe(name="t", kind="ttft_p99_ms", max=100), counts, 99.0).passed
    assert not judge_metric(Probe(name="t", kind="ttft_p99_ms", max=100), counts, None).passed
    assert judge_metric(Probe(name="r", kind="rejected_min", max=3), counts, None).passed
    assert not judge_metric(Probe(name="r", kind="rejected_min", max=4), counts, None).passed


def test_drained_probe_times_each_injection_to_the_daemons_weight_0(tmp_path: Path) -> None:
    """The daemon's first weight-0 transition of the injected worker after the injection
    is its detection time; a probe passes within `max` and fails past it or undrained."""
    run = _run(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2")
    run.injected_at = [("kill w1", "w1", 100.0), ("kill w2", "w2", 100.0)]
    log = tmp_path / "transitions.jsonl"
    log.write_text("\n".join(json.dumps(t) for t in (
        {"worker": "w1", "weight": 0, "ts": 99.0},  # before the injection: not its detection
        {"worker": "w1", "weight": 1, "ts": 100.5},
        {"worker": "w1", "weight": 0, "ts": 101.25},
    )) + "\nnot json\n")
    drained = detections(run, log)
    assert drained == {"kill w1": 1.25, "kill w2": None}
    assert judge_drained(run, Probe(name="d", kind="drained_s", max=2, workers=("w1",)),
                         drained).passed
    assert not judge_drained(run, Probe(name="d", kind="drained_s", max=1, workers=("w1",)),
                             drained).passed
    outcome = judge_drained(run, Probe(name="d", kind="drained_s", max=2), drained)
    assert "kill w2: not drained" in outcome.detail
    assert detections(run, tmp_path / "missing.jsonl") == {}
