"""One-shot probes with a shape set: streamed answers judged by shape, reports labelled."""

from __future__ import annotations

import json

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.health.canaryset import SHAPE_NOTE, CanarySet
from dynamo_ftctl.health.probe import ProbeTarget, probe_workers
from dynamo_ftctl.http1 import Reply
from dynamo_ftctl.inventory.canary import CanaryConfig
from dynamo_ftctl.structs import convert_struct

from .fakes import SET, FakeWorkers, good

URL = "http://w1"
CONFIG = CanaryConfig(max_retries=0, timeout_s=5.0, parallel_prompts=False)
SHAPE = convert_struct({
    "kind": "shape", "model": "m", "latency_tolerance": 2.0,
    "prompts": [{"name": "a", "prompt": "one", "max_tokens": 4, "finish_reasons": ["length"],
                 "token_count": [4, 4], "ttft_s": 0.05, "total_s": 0.1}],
}, CanarySet)


def stream(text: str, *, tokens: int = 4, finish: str | None = "length",
           first_byte_s: float | None = 0.01) -> Reply:
    """An SSE completion of `tokens` chunks (usage at the end), as the sim streams one."""
    events = [{"choices": [{"index": 0, "text": text[i:i + 1] if i < len(text) else "",
                            "finish_reason": None}]} for i in range(tokens)]
    events.append({"choices": [{"index": 0, "text": "", "finish_reason": finish}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                            "total_tokens": tokens + 1}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return Reply(200, body.encode(), {"content-type": "text/event-stream"}, first_byte_s)


def probe(reply: Reply, latency_s: float = 0.02) -> tuple[object, ...]:
    """Probe one fake worker answering `reply`: (verdict, kind, reason, report)."""
    clock = FakeClock()
    fake = FakeWorkers(clock, behaviour={URL: lambda _: reply}, latency_s={URL: latency_s})
    report = probe_workers([ProbeTarget("w1", URL)], SHAPE, CONFIG, transport=fake,
                           clock=clock, set_name="shape.yaml")
    result = report.results[0]
    return result.verdict, result.kind, result.reason, report


def test_any_text_of_the_right_shape_is_healthy() -> None:
    """Two different answers of the recorded shape both pass: content is not judged."""
    for text in ("abcd", "wxyz"):
        verdict, kind, _, _ = probe(stream(text))
        assert (verdict, kind) == ("healthy", "ok")


@pytest.mark.parametrize(("reply", "latency", "kind", "words"), [
    (stream(""), 0.02, "empty_answer", "empty answer"),
    (stream("ab", tokens=2), 0.02, "token_count", "2 tokens generated, recorded 4-4"),
    (stream("abcd", finish="abort"), 0.02, "finish_mismatch", "'abort', recorded length"),
    (stream("abcd", finish=None), 0.02, "bad_response", "without a finish reason"),
    (stream("abcd", first_byte_s=0.15), 0.2, "slow_answer", "time to first token"),
    (stream("abcd", first_byte_s=0.01), 0.5, "slow_answer", "answer took 500 ms"),
    (stream("abcd", first_byte_s=None), 0.15, "slow_answer", "time to first token"),
])
def test_an_answer_off_its_shape_is_unhealthy(reply: Reply, latency: float, kind: str,
                                              words: str) -> None:
    """Empty, short, a wrong finish, cut, slow to start or to end: exit 1, one line."""
    verdict, got, reason, report = probe(reply, latency)
    assert (verdict, got) == ("unhealthy", kind)
    assert words in str(reason)
    assert report.exit_code == 1  # type: ignore[attr-defined]


def test_reports_say_a_shape_set_judged_and_what_it_cannot_see() -> None:
    """Text and JSON name the set's kind and the weaker promise; exact sets say theirs."""
    _, _, _, report = probe(stream("abcd"))
    doc = report.to_json()  # type: ignore[attr-defined]
    assert (doc["set_kind"], doc["set_note"]) == ("shape", SHAPE_NOTE)
    assert SHAPE_NOTE in report.plain_text()  # type: ignore[attr-defined]
    assert doc["workers"][0]["checks"][0]["ttft_s"] == pytest.approx(0.01)
    clock = FakeClock()
    exact = probe_workers([ProbeTarget("w1", URL)], SET, CONFIG, clock=clock,
                          transport=FakeWorkers(clock, behaviour={URL: good}))
    assert exact.to_json()["set_kind"] == "exact"
    assert "judged by a exact set" not in exact.plain_text()
    assert "judged by an exact set" in exact.plain_text()


def test_shape_requests_stream_with_usage() -> None:
    """A shape set's request streams (its TTFT is timed) and asks for the usage count."""
    from dynamo_ftctl.health.judge import build_request

    _, body = build_request(SHAPE, SHAPE.prompts[0])
    sent = json.loads(body)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["temperature"] == 0.0


def test_the_daemon_labels_its_set_and_judges_by_shape() -> None:
    """`GET /workers` names a shape set and its note; a worker off its shape goes unhealthy."""
    import asyncio

    from dynamo_ftctl.health.daemon import HealthDaemon, WatchedWorker
    from dynamo_ftctl.health.state import HealthState

    from .fakes import AsyncFakeWorkers

    clock = FakeClock()
    fake = AsyncFakeWorkers(clock, behaviour={"http://sh0": lambda _: stream("abcd"),
                                              "http://sh1": lambda _: stream("")},
                            latency_s={"http://sh0": 0.02, "http://sh1": 0.02})
    workers = [WatchedWorker(ProbeTarget(f"sh{i}", f"http://sh{i}", "m")) for i in range(2)]
    daemon = HealthDaemon(workers, SHAPE, CONFIG, clock=clock, transport=fake, metrics=False)
    asyncio.run(daemon.probe_round())
    snap = daemon.snapshot()
    assert (snap["set_kind"], snap["set_note"]) == ("shape", SHAPE_NOTE)
    states = {row["name"]: row["state"] for row in snap["workers"]}
    assert states == {"sh0": HealthState.HEALTHY.value, "sh1": HealthState.UNHEALTHY.value}
