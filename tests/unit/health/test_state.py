"""The worker state machine and circuit breaker, driven by a fake clock."""

from __future__ import annotations

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.health.state import BreakerState, HealthState, MachineConfig, WorkerHealth


def machine(clock: FakeClock, **kw: float) -> WorkerHealth:
    config = MachineConfig(**{"failure_threshold": 3, "recovery_s": 60.0,  # type: ignore[arg-type]
                              "dead_after_trials": 2, **kw})
    return WorkerHealth("w1", config, clock)


def open_breaker(health: WorkerHealth) -> None:
    for _ in range(3):
        health.record(False, "boom")


def test_one_failure_is_suspicious_at_half_weight() -> None:
    """HEALTHY -> SUSPICIOUS (weight 0.5) on a failure; a success brings it back."""
    health = machine(FakeClock())
    transition = health.record(False, "token mismatch")
    assert transition is not None
    assert (transition.previous, transition.state) == (HealthState.HEALTHY, HealthState.SUSPICIOUS)
    assert health.weight == 0.5
    back = health.record(True, "ok")
    assert back is not None
    assert back.state is HealthState.HEALTHY
    assert health.weight == 1.0


def test_threshold_consecutive_failures_open_the_breaker() -> None:
    """Three consecutive failures: UNHEALTHY, weight 0, breaker open, no probes allowed."""
    clock = FakeClock()
    health = machine(clock)
    assert health.record(False, "a") is not None
    assert health.record(False, "b") is None
    transition = health.record(False, "c")
    assert transition is not None
    assert transition.state is HealthState.UNHEALTHY
    assert transition.breaker is BreakerState.OPEN
    assert health.weight == 0.0
    assert not health.allow_probe()
    clock.advance(59.9)
    assert not health.allow_probe()
    assert health.retry_in() is not None


def test_a_success_between_failures_resets_the_count() -> None:
    """Failures must be consecutive to reach UNHEALTHY."""
    health = machine(FakeClock())
    health.record(False, "a")
    health.record(False, "b")
    health.record(True, "ok")
    health.record(False, "c")
    health.record(False, "d")
    assert health.state is HealthState.SUSPICIOUS


def test_recovery_through_one_half_open_trial() -> None:
    """After recovery_s one trial goes out (half-open); its success closes the breaker."""
    clock = FakeClock()
    health = machine(clock)
    open_breaker(health)
    clock.advance(60)
    assert health.allow_probe()
    assert health.breaker is BreakerState.HALF_OPEN
    assert not health.allow_probe()  # only one trial
    assert health.record(False, "proxy says no", "proxy") is None  # passive: ignored
    transition = health.record(True, "ok")
    assert transition is not None
    assert transition.state is HealthState.HEALTHY
    assert health.breaker is BreakerState.CLOSED
    assert "half-open trial passed" in transition.reason


def test_failed_trials_drain_then_kill() -> None:
    """First failed trial: DRAINING; second: DEAD; each reopens the breaker for recovery_s."""
    clock = FakeClock()
    health = machine(clock)
    open_breaker(health)
    clock.advance(60)
    assert health.allow_probe()
    first = health.record(False, "timeout")
    assert first is not None
    assert first.state is HealthState.DRAINING
    assert health.breaker is BreakerState.OPEN
    clock.advance(30)
    assert not health.allow_probe()
    clock.advance(30)
    assert health.allow_probe()
    second = health.record(False, "timeout")
    assert second is not None
    assert second.state is HealthState.DEAD
    clock.advance(60)
    assert health.allow_probe()
    revived = health.record(True, "ok")
    assert revived is not None
    assert (revived.previous, revived.state) == (HealthState.DEAD, HealthState.HEALTHY)


def test_passive_reports_count_while_closed_and_are_ignored_while_open() -> None:
    """A proxy report is a failure like a probe's; with the breaker open it carries no news."""
    clock = FakeClock()
    health = machine(clock)
    transition = health.record(False, "stream broke", "proxy")
    assert transition is not None
    assert transition.source == "proxy"
    health.record(False, "x", "gpu")
    health.record(False, "y", "proxy")
    assert health.state is HealthState.UNHEALTHY
    assert health.record(False, "z", "proxy") is None
    assert health.record(True, "ok", "probe") is None  # open: not a trial


def test_thresholds_are_configurable() -> None:
    """failure_threshold 1 and dead_after_trials 1: one failure kills after one trial."""
    clock = FakeClock()
    health = machine(clock, failure_threshold=1, dead_after_trials=1, recovery_s=5.0)
    transition = health.record(False, "a")
    assert transition is not None
    assert transition.state is HealthState.UNHEALTHY
    clock.advance(5)
    assert health.allow_probe()
    dead = health.record(False, "b")
    assert dead is not None
    assert dead.state is HealthState.DEAD


def test_only_a_probe_success_restores_confidence() -> None:
    """A success from the proxy or the GPU watcher changes nothing; a probe's success restores."""
    health = machine(FakeClock())
    health.record(False, "token mismatch")
    health.record(False, "token mismatch")
    for source in ("proxy", "gpu"):
        assert health.record(True, "ok", source) is None
        assert (health.state, health.consecutive_failures) == (HealthState.SUSPICIOUS, 2)
    assert health.last_reason == "token mismatch"
    back = health.record(True, "canary passed", "probe")
    assert back is not None
    assert back.state is HealthState.HEALTHY
