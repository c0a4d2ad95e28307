"""Chaos drills: the orchestration layer above the core services (docs/drill.md).

`run_drill` runs a scenario (`drill.scenario`) top to bottom (`runner`):
hypothesis before (`hypothesis`) → method: load, timeline of faults and probes,
witness streams (`method`, `witness`) → rollbacks, always (`rollback`) →
hypothesis after → report (`counts`, `report`). With `local=True` it starts the
inventory on loopback first (`local`). Only the CLI imports this package.
"""

from __future__ import annotations

from dynamo_ftctl.drill.report import DrillReport
from dynamo_ftctl.drill.runner import run_drill
from dynamo_ftctl.drill.state import ProbeOutcome, TimelineEvent

__all__ = ["DrillReport", "ProbeOutcome", "TimelineEvent", "run_drill"]
