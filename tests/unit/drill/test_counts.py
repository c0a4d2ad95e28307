"""The method's counts: requests and tokens per load and per priority, and cut streams."""

from __future__ import annotations

import json
from pathlib import Path

from dynamo_ftctl.drill import DrillReport
from dynamo_ftctl.drill.counts import cut_streams, load_counts, loads_counts
from dynamo_ftctl.drill.hypothesis import judge_metric
from dynamo_ftctl.drill.report import write_report
from dynamo_ftctl.drill.scenario import LoadProfile, Probe
from dynamo_ftctl.loadgen.record import RequestRecord
from tests.unit.drill.samples import LoadRun, drill_report, record


def test_load_counts_tokens_lost_and_duplicated() -> None:
    """Completed answers shorter than max_tokens lost tokens; longer ones repeated some."""
    records = [record(0, 48), record(1, 45, migrated=1), record(2, 50),
               record(3, 0, outcome="http_error", status=503)]
    counts = load_counts(LoadRun(records), 48)  # type: ignore[arg-type]
    assert counts["sent"] == 4
    assert counts["failed"] == 1
    assert counts["rejected"] == 1
    assert counts["migrated"] == 1
    assert counts["tokens_lost"] == 3
    assert counts["tokens_duplicated"] == 2


def test_every_shed_status_counts_as_a_refusal_not_a_failure() -> None:
    """429 (a worker's backpressure passed on by the proxy), 503 and 529 are refusals: an
    admitted request that failed is none of them."""
    records = [record(i, 0, outcome="http_error", status=status)
               for i, status in enumerate((429, 503, 529, 500))]
    counts = load_counts(LoadRun(records), 48)  # type: ignore[arg-type]
    assert counts["rejected"] == 3
    assert counts["admitted_error_rate"] == 1.0


def test_loads_counts_per_priority_and_admitted_error_rate() -> None:
    """Several profiles: totals plus sent/failed/shed per priority; sheds (with Retry-After)
    are failures but not failures of admitted requests."""
    shed = RequestRecord(index=9, target="t", planned=1.0, sent=1.0, done=1.1, first_token=None,
                         output_tokens=0, itl=(), status=503, outcome="5xx_503",
                         retry_after_s=1.0)
    premium = [record(0, 32), record(1, 32)]
    best = [record(2, 64), shed, record(3, 10, outcome="broken_stream", status=200)]
    counts = loads_counts([
        (LoadProfile(priority="premium", max_tokens=32), LoadRun(premium)),  # type: ignore[list-item]
        (LoadProfile(priority="best_effort", max_tokens=64), LoadRun(best)),  # type: ignore[list-item]
    ])
    assert counts["sent"] == 5
    assert counts["by_priority"]["premium"] == {**counts["by_priority"]["premium"],
                                                "sent": 2, "failed": 0, "rejected": 0}
    tier = counts["by_priority"]["best_effort"]
    assert (tier["sent"], tier["failed"], tier["rejected"], tier["shed_with_retry_after"]) == (
        3, 2, 1, 1)
    assert tier["admitted_error_rate"] == 0.5

    def probe(priority: str) -> Probe:
        return Probe(name="p", kind="admitted_error_rate", priority=priority, max=0)

    assert not judge_metric(probe("best_effort"), counts, None).passed
    assert judge_metric(probe("premium"), counts, None).passed
    assert "no standard load" in judge_metric(probe("standard"), counts, None).detail


def test_cut_streams_count_moved_streams_and_those_that_continued_intact(tmp_path: Path) -> None:
    """Moved load streams are intact only with all their tokens; witnesses only with the
    fault-free run's ids; the summary, report.md and report.json say both numbers."""
    records = [record(0, 48, migrated=1), record(1, 40, migrated=1), record(2, 48),
               record(3, 0, outcome="broken_stream", migrated=1)]
    witness = {"cut": 21, "cut_intact": 20, "cut_failed": 1}
    cut = cut_streams([(LoadProfile(max_tokens=48), LoadRun(records))],  # type: ignore[list-item]
                      witness)
    assert cut == {"streams": 25, "continued_intact": 21, "witness": 22,
                   "witness_token_identical": 20, "load": 3, "load_complete": 1}
    base = drill_report(tmp_path)
    report = write_report(DrillReport(**{**base.__dict__, "counts": {**base.counts, "cut": cut}}),
                          plot=False)
    line = ("streams cut mid-generation: 25, continued intact: 21 (20 of 22 witness streams "
            "token-identical to an uninterrupted run; 1 of 3 load streams complete with every "
            "token)")
    assert f"  {line}" in report.summary_lines()
    assert line.capitalize() in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["cut_streams"] == cut
