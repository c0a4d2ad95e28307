"""What one drill records while it runs: probe verdicts, timeline events, the run's state.

Each stage (`hypothesis`, `method`, `rollback`) reads the scenario and the
inventory from one `DrillRun` and appends what it saw to it; `runner` turns it
into a `DrillReport` at the end. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from dynamo_ftctl.clock import Clock
    from dynamo_ftctl.drill.scenario import Scenario
    from dynamo_ftctl.drill.witness import WitnessStream
    from dynamo_ftctl.health.canaryset import CanarySet
    from dynamo_ftctl.inventory import Inventory

__all__ = ["DrillRun", "ProbeOutcome", "TimelineEvent"]


@dataclass(frozen=True)
class ProbeOutcome:
    """One probe's verdict at one phase."""

    name: str
    kind: str
    phase: str
    passed: bool
    detail: str
    t_s: float | None = None


@dataclass(frozen=True)
class TimelineEvent:
    """Something the method did at `t_s` seconds into the load."""

    t_s: float
    label: str
    result: str


def _quiet(_: str) -> None:
    """The default log: a library call prints nothing."""


@dataclass
class DrillRun:
    """Mutable state of one drill while it runs."""

    scenario: Scenario
    inventory: Inventory  # with `--local`: the inventory of what the drill started
    out_dir: Path
    clock: Clock
    env: dict[str, str]  # secrets for what the drill starts and injects into
    target_url: str  # the migrating proxy
    pids: dict[str, int] = field(default_factory=dict)
    events: list[TimelineEvent] = field(default_factory=list)
    probes: list[ProbeOutcome] = field(default_factory=list)
    states: list[tuple[float, str, str]] = field(default_factory=list)  # (t_s, worker, state)
    rollbacks: list[str] = field(default_factory=list)
    canary_set: CanarySet | None = None
    injected_at: list[tuple[str, str, float]] = field(default_factory=list)  # label, worker, wall
    proxy_migrations: int | None = None
    t0: float | None = None  # clock.now() when the load began
    log: Callable[[str], None] = _quiet
    local: bool = False  # a local drill writes Xid lines to its own kmsg.log
    witnesses: list[WitnessStream] | None = None
    live_witnesses: list[WitnessStream] | None = None  # while they stream
