"""`record_shape_set` with a scripted worker and a fake clock: what a shape is made of."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import CheckFailed
from dynamo_ftctl.health.canaryset import CanarySet
from dynamo_ftctl.health.probe import ProbeTarget
from dynamo_ftctl.health.record import MIN_BASELINE_S, record_shape_set
from dynamo_ftctl.http1 import Reply, Request

TARGET = ProbeTarget("w1", "http://w1")


@dataclass
class Scripted:
    """Answers one (text, tokens, finish, seconds, first byte) after another, as SSE."""

    clock: FakeClock
    script: Iterator[tuple[str, int, str | None, float, float]]

    def handle_request(self, request: Request) -> Reply:
        """The `http1.Transport` seam."""
        assert request.json()["stream"] is True
        text, tokens, finish, seconds, first = next(self.script)
        self.clock.advance(seconds)
        events = [{"choices": [{"index": 0, "text": text, "finish_reason": finish}]},
                  {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                            "total_tokens": tokens + 1}}]
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return Reply(200, data.encode(), {"content-type": "text/event-stream"}, first)


def record(script: list[tuple[str, int, str | None, float, float]], **options: float,
           ) -> CanarySet:
    """Record one prompt (max_tokens 16) from the script, without a warm-up."""
    clock = FakeClock()
    return record_shape_set(TARGET, model="m", prompts=[("a", "hi")], max_tokens=16,
                            samples=len(script), warmup_timeout_s=0, clock=clock,
                            transport=Scripted(clock, iter(script)), **options)


def test_a_shape_keeps_finishes_counts_and_the_slowest_latencies() -> None:
    """All answers end on length: the count range is exact, baselines are the slowest."""
    recorded = record([("ab", 16, "length", 0.2, 0.08), ("cd", 16, "length", 0.3, 0.06)],
                      latency_tolerance=6.0)
    prompt = recorded.prompts[0]
    assert (recorded.kind, recorded.samples, recorded.tolerance) == ("shape", 2, 6.0)
    assert prompt.finish_reasons == ("length",)
    assert prompt.token_count == (16, 16)
    assert (prompt.ttft_s, prompt.total_s) == (pytest.approx(0.08), pytest.approx(0.3))


def test_early_stops_widen_the_range_and_fast_answers_get_the_floor() -> None:
    """A stop may come anywhere: the range widens by a quarter of its top; 1 ms is 50 ms."""
    recorded = record([("ab", 8, "stop", 0.001, 0.0005), ("cd", 12, "length", 0.001, 0.0005)])
    prompt = recorded.prompts[0]
    assert prompt.finish_reasons == ("stop", "length")
    assert prompt.token_count == (5, 15)
    assert prompt.ttft_s == prompt.total_s == MIN_BASELINE_S


@pytest.mark.parametrize(("sample", "words"), [
    (("", 3, "length", 0.1, 0.05), "an empty answer"),
    (("ab", 3, None, 0.1, 0.05), "without a finish reason"),
])
def test_an_unusable_sample_records_nothing(sample: tuple[str, int, str | None, float, float],
                                            words: str) -> None:
    """An empty or cut answer at record time: CheckFailed naming the worker and prompt."""
    with pytest.raises(CheckFailed) as info:
        record([("ok", 3, "length", 0.1, 0.05), sample])
    assert words in str(info.value)
    assert "'w1'" in str(info.value)
