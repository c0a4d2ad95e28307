"""The worker health state machine and its circuit breaker, driven by a `Clock`.

States and routing weights (the proxy reads them from `GET /workers`):

    HEALTHY (1.0) --failure--> SUSPICIOUS (0.5) --threshold consecutive--> UNHEALTHY (0)
        ^                          |  success                                   | breaker OPEN
        |                          v                                            v
        +------ HEALTHY <----------+          after recovery_s: one HALF-OPEN trial probe
        +------ trial succeeds: breaker CLOSED, HEALTHY  <----------------------+
                trial fails: breaker OPEN again; UNHEALTHY -> DRAINING,
                             `dead_after_trials` failed trials -> DEAD

Only a half-open trial brings a worker back from UNHEALTHY, DRAINING or DEAD.
While the breaker is open, nothing is sent to the worker and passive reports
are ignored (they carry no news). While it is half-open, only the trial's own
result counts. Passive signals (the proxy, the GPU watcher) can only lower
confidence: a success from one of them is ignored, since only a passing probe
shows that the worker answers correctly (forged `ok` reports would otherwise keep a
worker with silent data corruption HEALTHY). `record` returns
the `Transition` it caused (or None).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from dynamo_ftctl.inventory.canary import CanaryConfig

__all__ = [
    "STATE_WEIGHTS",
    "BreakerState",
    "HealthState",
    "MachineConfig",
    "SignalSource",
    "Transition",
    "WorkerHealth",
]

SignalSource = Literal["probe", "proxy", "gpu"]


class HealthState(StrEnum):
    """Where a worker stands."""

    HEALTHY = "healthy"
    SUSPICIOUS = "suspicious"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DEAD = "dead"


class BreakerState(StrEnum):
    """The circuit breaker (gauge values: closed 0, open 1, half-open 2)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def gauge(self) -> int:
        """`ftctl_circuit_breaker_state` value."""
        return {"closed": 0, "open": 1, "half_open": 2}[self.value]


# docs/design.md "Health states": SUSPICIOUS routes at half weight; UNHEALTHY and worse get nothing.
STATE_WEIGHTS: dict[HealthState, float] = {
    HealthState.HEALTHY: 1.0, HealthState.SUSPICIOUS: 0.5, HealthState.UNHEALTHY: 0.0,
    HealthState.DRAINING: 0.0, HealthState.DEAD: 0.0,
}


@dataclass(frozen=True)
class MachineConfig:
    """Thresholds of the state machine and breaker."""

    failure_threshold: int = 3
    recovery_s: float = 60.0
    dead_after_trials: int = 2

    @classmethod
    def from_canary(cls, config: CanaryConfig) -> MachineConfig:
        """The inventory's `canary:` settings."""
        return cls(config.failure_threshold, config.recovery_s, config.dead_after_trials)


@dataclass(frozen=True)
class Transition:
    """One state change, as logged (JSON line) and passed to actions."""

    worker: str
    previous: HealthState
    state: HealthState
    breaker: BreakerState
    reason: str
    source: SignalSource
    at: float
    weight: float

    def to_json(self) -> dict[str, Any]:
        return {"event": "transition", "ts": round(self.at, 3), "worker": self.worker,
                "previous": self.previous.value, "state": self.state.value,
                "weight": self.weight, "breaker": self.breaker.value,
                "source": self.source, "reason": self.reason}


class WorkerHealth:
    """One worker's state, consecutive failures and breaker."""

    def __init__(self, name: str, config: MachineConfig | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.name = name
        self.config = config or MachineConfig()
        self.clock = clock
        self.state = HealthState.HEALTHY
        self.breaker = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.failed_trials = 0
        self.opened_at: float | None = None
        self.last_reason = "not probed yet"
        self.last_change = clock.wall()

    @property
    def weight(self) -> float:
        """Routing weight of the current state (half-open: 0 until the trial succeeds)."""
        return STATE_WEIGHTS[self.state]

    def retry_in(self) -> float | None:
        """Seconds until the open breaker allows its trial (None unless open)."""
        if self.breaker is not BreakerState.OPEN or self.opened_at is None:
            return None
        return max(0.0, self.opened_at + self.config.recovery_s - self.clock.now())

    def allow_probe(self) -> bool:
        """May a probe go out now? An open breaker past `recovery_s` turns half-open (trial)."""
        if self.breaker is BreakerState.CLOSED:
            return True
        if self.breaker is BreakerState.HALF_OPEN:
            return False  # the one trial is in flight
        if self.retry_in() == 0.0:
            self.breaker = BreakerState.HALF_OPEN
            return True
        return False

    def record(self, ok: bool, reason: str, source: SignalSource = "probe") -> Transition | None:
        """Fold in one signal; return the transition it caused, if any."""
        if self.breaker is BreakerState.OPEN or (ok and source != "probe"):
            return None
        if self.breaker is BreakerState.HALF_OPEN:
            if source != "probe":
                return None
            return self._trial(ok, reason)
        self.last_reason = reason
        if ok:
            self.consecutive_failures = 0
            if self.state is HealthState.SUSPICIOUS:
                return self._move(HealthState.HEALTHY, reason, source)
            return None
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.config.failure_threshold:
            self._open()
            return self._move(HealthState.UNHEALTHY, reason, source)
        if self.state is HealthState.HEALTHY:
            return self._move(HealthState.SUSPICIOUS, reason, source)
        return None

    def _trial(self, ok: bool, reason: str) -> Transition | None:
        self.last_reason = reason
        if ok:
            self.breaker = BreakerState.CLOSED
            self.consecutive_failures = 0
            self.failed_trials = 0
            self.opened_at = None
            return self._move(HealthState.HEALTHY, f"half-open trial passed: {reason}", "probe")
        self.failed_trials += 1
        self._open()
        if self.failed_trials >= self.config.dead_after_trials:
            target = HealthState.DEAD
        elif self.state is HealthState.UNHEALTHY:
            target = HealthState.DRAINING
        else:
            target = self.state
        if target is self.state:
            return None
        return self._move(target, f"half-open trial {self.failed_trials} failed: {reason}",
                          "probe")

    def _open(self) -> None:
        self.breaker = BreakerState.OPEN
        self.opened_at = self.clock.now()

    def _move(self, state: HealthState, reason: str, source: SignalSource) -> Transition:
        previous, self.state = self.state, state
        self.last_change = self.clock.wall()
        return Transition(self.name, previous, state, self.breaker, reason, source,
                          self.last_change, self.weight)
