"""Request records, load reports and a drill report for the drill's unit tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo_ftctl.drill import DrillReport, ProbeOutcome, TimelineEvent
from dynamo_ftctl.loadgen.record import RequestRecord

if TYPE_CHECKING:
    from pathlib import Path


def record(index: int, tokens: int, outcome: str = "ok", status: int | None = 200,
           migrated: int = 0) -> RequestRecord:
    """Request `index`, planned at `index` s, answered with `tokens` tokens."""
    return RequestRecord(index=index, target="t", planned=float(index), sent=float(index),
                         done=index + 0.5, first_token=index + 0.1, output_tokens=tokens,
                         itl=(), status=status, outcome=outcome, migrated=migrated)


class LoadRun:
    """The part of a `LoadReport` the drill's counts read: its records."""

    def __init__(self, records: list[RequestRecord]) -> None:
        self.records = tuple(records)


def drill_report(tmp_path: Path) -> DrillReport:
    """A passed local drill: w2 killed at 1 s and down from 1.2 s to 2.7 s."""
    return DrillReport(
        scenario="drills/x.yaml", title="x", local=True, passed=True, started_at=0.0,
        elapsed_s=3.0, error=None,
        counts={"sent": 4, "completed": 4, "failed": 0, "migrated": 1, "rejected": 0,
                "tokens_lost": 0, "tokens_duplicated": 0, "error_rate": 0.0},
        latency={"ttft_p50_ms": 10.0, "ttft_p99_ms": 40.0, "ttft_p99_before_fault_ms": 12.0,
                 "ttft_p99_after_fault_ms": 40.0},
        probes=(ProbeOutcome("up", "workers_healthy", "before", True, "ok"),),
        events=(TimelineEvent(1.0, "kill w2", "sent SIGKILL"),),
        rollbacks=("restarted: w2",),
        states=((0.0, "w2", "up"), (1.2, "w2", "down"), (2.7, "w2", "up")),
        out_dir=tmp_path,
        records=((0.0, 0.5, 0.01, True, 200), (1.0, 1.6, 0.04, True, 200),
                 (2.0, 2.5, 0.02, True, 200)),
    )
