"""One-shot probes against fake workers: verdicts, retries, latency spikes, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.health.baseline import MIN_SAMPLES, BaselineStore
from dynamo_ftctl.health.probe import ProbeTarget, probe_worker, probe_workers
from dynamo_ftctl.inventory.canary import CanaryConfig

from .fakes import SET, FakeWorkers, corrupt, refused, reset

URL = "http://w1"
# One prompt after another: the fake transport's time then adds up deterministically.
CONFIG = CanaryConfig(max_retries=2, timeout_s=1.0, parallel_prompts=False)


def test_healthy_worker_exits_zero() -> None:
    """Every prompt matches: healthy, exit 0, latency is the sum of the prompts'."""
    clock = FakeClock()
    fake = FakeWorkers(clock, latency_s={URL: 0.02})
    result = probe_worker(ProbeTarget("w1", URL), SET, CONFIG, transport=fake, clock=clock)
    assert result.verdict == "healthy"
    assert result.exit_code == 0
    assert result.latency_s == pytest.approx(0.04)


def test_corrupted_tokens_exit_one_with_position() -> None:
    """Silent data corruption: unhealthy, exit 1, first differing position named."""
    clock = FakeClock()
    fake = FakeWorkers(clock, behaviour={URL: corrupt})
    result = probe_worker(ProbeTarget("w1", URL), SET, CONFIG, transport=fake, clock=clock)
    assert (result.verdict, result.kind, result.exit_code) == ("unhealthy", "token_mismatch", 1)
    assert result.mismatch is not None
    assert (result.mismatch.position, result.mismatch.expected, result.mismatch.got) == (1, 2, 102)


def test_refusal_is_unreachable_and_not_retried() -> None:
    """A refused connection is a verdict (exit 3) after one attempt, and stops the probe."""
    clock = FakeClock()
    fake = FakeWorkers(clock, behaviour={URL: refused})
    result = probe_worker(ProbeTarget("w1", URL), SET, CONFIG, transport=fake, clock=clock)
    assert (result.verdict, result.exit_code) == ("unreachable", 3)
    assert len(fake.calls) == 1


def test_transient_errors_are_retried_max_retries_times() -> None:
    """A reset is retried max_retries times with backoff on the clock, then unreachable."""
    clock = FakeClock()
    fake = FakeWorkers(clock, behaviour={URL: reset})
    result = probe_worker(ProbeTarget("w1", URL), SET, CONFIG, transport=fake, clock=clock)
    assert result.verdict == "unreachable"
    assert len(fake.calls) == 3
    assert result.checks[0].attempts == 3
    assert clock.sleeps == [0.05, 0.1]


def test_latency_spike_after_baseline(tmp_path: Path) -> None:
    """Once MIN_SAMPLES probes built the baseline, a 5x slower probe is a latency spike."""
    clock = FakeClock()
    fake = FakeWorkers(clock, latency_s={URL: 0.05})
    store = BaselineStore(tmp_path / "canary.json")
    target = ProbeTarget("w1", URL)
    for _ in range(MIN_SAMPLES):
        ok = probe_worker(target, SET, CONFIG, transport=fake, clock=clock, store=store)
        assert ok.healthy
    fake.latency_s[URL] = 0.25
    result = probe_worker(target, SET, CONFIG, transport=fake, clock=clock, store=store)
    assert (result.verdict, result.kind) == ("unhealthy", "latency_spike")
    assert result.baseline_s == pytest.approx(0.1)
    assert "5.0x" in result.reason
    # the spike did not become the new normal
    assert store.load().entries["w1"].samples == MIN_SAMPLES


def test_report_exit_code_prefers_wrong_answers_over_silence() -> None:
    """Several workers: 1 if any answered wrongly, else 3 if any was unreachable."""
    clock = FakeClock()
    fake = FakeWorkers(clock, behaviour={"http://w2": refused, "http://w3": corrupt})
    targets = [ProbeTarget("w1", URL), ProbeTarget("w2", "http://w2")]
    assert probe_workers(targets, SET, CONFIG, transport=fake, clock=clock).exit_code == 3
    targets.append(ProbeTarget("w3", "http://w3"))
    assert probe_workers(targets, SET, CONFIG, transport=fake, clock=clock).exit_code == 1
    assert probe_workers(targets[:1], SET, CONFIG, transport=fake, clock=clock).exit_code == 0


def test_wrong_model_is_bad_input() -> None:
    """A worker serving another model than the set's is an InvalidInput (exit 2)."""
    with pytest.raises(InvalidInput, match="serves 'other'"):
        probe_worker(ProbeTarget("w1", URL, "other"), SET, CONFIG,
                     transport=FakeWorkers(FakeClock()))


class _Rendezvous:
    """A transport whose answers wait until every prompt of the set has arrived (or 5 s)."""

    def __init__(self, expected: int, behaviour: object = None) -> None:
        import threading

        self.barrier = threading.Barrier(expected, timeout=5)
        self.behaviour = behaviour
        self.calls = 0

    def handle_request(self, request: object) -> object:
        import json

        from .fakes import good

        self.calls += 1
        self.barrier.wait()  # BrokenBarrierError unless the prompts are in flight together
        prompt = json.loads(request.body)["prompt"]  # type: ignore[attr-defined]
        result = (self.behaviour or good)(prompt)  # type: ignore[operator]
        if isinstance(result, Exception):
            raise result
        return result


def test_parallel_prompts_are_in_flight_together() -> None:
    """By default a set's prompts are sent at once; the verdict is the same."""
    fake = _Rendezvous(len(SET.prompts))
    result = probe_worker(ProbeTarget("w1", URL), SET, CanaryConfig(timeout_s=1.0),
                          transport=fake)  # type: ignore[arg-type]
    assert result.healthy, result.reason
    assert [c.prompt for c in result.checks] == [p.name for p in SET.prompts]
    assert result.latency_s == max(c.latency_s or 0.0 for c in result.checks)


def test_parallel_wrong_answer_and_refusal_keep_their_verdicts() -> None:
    """Sent at once, a corrupted worker is still unhealthy and a dead one unreachable."""
    for behaviour, verdict, code in ((corrupt, "unhealthy", 1), (refused, "unreachable", 3)):
        fake = _Rendezvous(len(SET.prompts), behaviour)
        report = probe_workers([ProbeTarget("w1", URL)], SET, CanaryConfig(timeout_s=1.0),
                               transport=fake)  # type: ignore[arg-type]
        assert (report.results[0].verdict, report.exit_code) == (verdict, code)
        assert fake.calls == len(SET.prompts)


def test_request_bodies_are_built_once_per_set_and_prompt() -> None:
    """The daemon's probes reuse one encoded body per prompt (10,000 workers send the same
    three), equal to `build_request`'s; another set with the same prompts gets its own."""
    from dynamo_ftctl.health.judge import build_request
    from dynamo_ftctl.health.probe import _request
    from dynamo_ftctl.structs import replace

    prompt = SET.prompts[0]
    first = _request(SET, prompt)
    assert first == build_request(SET, prompt)
    assert _request(SET, prompt) is first
    other = replace(SET, model="other-model")
    assert _request(other, prompt) == build_request(other, prompt)
    assert b"other-model" in _request(other, prompt)[1]
    assert _request(SET, prompt) == first
