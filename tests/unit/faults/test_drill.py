"""Drill scenarios validate with file:line errors; counts, probes and reports are computed right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.faults.drill import ProbeOutcome, TimelineEvent, _metric_probe, load_counts
from dynamo_ftctl.faults.drill_report import DrillReport, render_markdown, write_report
from dynamo_ftctl.faults.scenario import Probe, load_scenario
from dynamo_ftctl.loadgen.record import RequestRecord

DRILLS = Path(__file__).resolve().parents[3] / "drills"

INVENTORY = """cluster: t
workers:
  - name: w1
    url: http://127.0.0.1:8101
    model: m
    faults: [kill, sdc]
  - name: w2
    url: http://127.0.0.1:8102
    model: m
    protected: true
    faults: [kill]
"""

GOOD = """title: t
inventory: inv.yaml
hypothesis:
  probes:
    - {name: up, kind: workers_healthy}
method:
  timeline:
    - {at_s: 1, fault: kill, worker: w1}
"""


def _write(tmp_path: Path, scenario: str) -> Path:
    (tmp_path / "inv.yaml").write_text(INVENTORY)
    path = tmp_path / "s.yaml"
    path.write_text(scenario)
    return path


@pytest.mark.parametrize("name", ["worker-crash", "xid48", "sdc", "hang", "network", "overload"])
def test_shipped_drills_are_valid(name: str) -> None:
    """Every shipped drill validates against its local inventory."""
    scenario, inventory = load_scenario(DRILLS / f"{name}.yaml")
    assert scenario.title
    assert all(w.launch is not None for w in inventory.workers)


def test_good_scenario_loads(tmp_path: Path) -> None:
    """A minimal scenario loads with default rollbacks."""
    scenario, inventory = load_scenario(_write(tmp_path, GOOD))
    assert inventory.cluster == "t"
    assert [r.action for r in scenario.rollbacks] == ["revert_faults", "restart_workers"]


@pytest.mark.parametrize(("old", "new", "where"), [
    ("kind: workers_healthy", "kind: workers_happy", "s.yaml:5: hypothesis.probes[0].kind"),
    ("worker: w1}", "worker: w9}", "s.yaml:8: method.timeline[0].worker: no worker named 'w9'"),
    ("fault: kill, worker: w1", "fault: sdc, worker: w2",
     "s.yaml:8: method.timeline[0].worker: worker w2 is protected"),
    ("fault: kill, worker: w1", "fault: hang, worker: w1",
     "s.yaml:8: method.timeline[0].fault: fault 'hang' is not in worker w1's allowlist"),
    ("fault: kill, worker: w1", "fault: kil, worker: w1", "s.yaml:8: method.timeline[0].fault"),
    ("{at_s: 1, fault: kill, worker: w1}", "{at_s: 1}", "s.yaml:8: method.timeline[0].fault"),
    ("title: t", "title: t\ntitel: x", "s.yaml:2: titel"),
    ("worker: w1}", "worker: w1, witness_tokens: 4}",
     "s.yaml:8: method.timeline[0].witness_tokens: witness_tokens needs method.witness"),
    ("{name: up, kind: workers_healthy}", "{name: e, kind: error_rate}",
     "s.yaml:5: hypothesis.probes[0].max: a error_rate probe needs a tolerance"),
])
def test_bad_scenarios_name_file_line_and_key(tmp_path: Path, old: str, new: str,
                                              where: str) -> None:
    """Each mistake is one error naming the file, the line and the key."""
    assert old in GOOD
    with pytest.raises(InventoryError) as caught:
        load_scenario(_write(tmp_path, GOOD.replace(old, new)))
    assert where in str(caught.value)


def test_bad_scenario_exits_2_from_the_cli(tmp_path: Path) -> None:
    """`ftctl drill` on an invalid scenario exits 2 with one error line and starts nothing."""
    path = _write(tmp_path, GOOD.replace("worker: w1}", "worker: w9}"))
    done = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "drill", str(path), "--local",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert "s.yaml:8: method.timeline[0].worker" in done.stderr
    assert not (tmp_path / "out").exists()


def _record(index: int, tokens: int, outcome: str = "ok", status: int | None = 200,
            migrated: int = 0) -> RequestRecord:
    return RequestRecord(index=index, target="t", planned=float(index), sent=float(index),
                         done=index + 0.5, first_token=index + 0.1, output_tokens=tokens,
                         itl=(), status=status, outcome=outcome, migrated=migrated)


class _Report:
    def __init__(self, records: list[RequestRecord]) -> None:
        self.records = tuple(records)


def test_load_counts_tokens_lost_and_duplicated() -> None:
    """Completed answers shorter than max_tokens lost tokens; longer ones repeated some."""
    records = [_record(0, 48), _record(1, 45, migrated=1), _record(2, 50),
               _record(3, 0, outcome="http_error", status=503)]
    counts = load_counts(_Report(records), 48)  # type: ignore[arg-type]
    assert counts["sent"] == 4
    assert counts["failed"] == 1
    assert counts["rejected"] == 1
    assert counts["migrated"] == 1
    assert counts["tokens_lost"] == 3
    assert counts["tokens_duplicated"] == 2


def test_metric_probes_judge_tolerances() -> None:
    """≤ tolerances pass at the bound and fail past it; rejected_min needs at least max."""
    counts = {"failed": 0, "error_rate": 0.1, "rejected": 3, "tokens_lost": 0}
    assert _metric_probe(Probe(name="f", kind="failed", max=0), counts, None).passed
    assert not _metric_probe(Probe(name="e", kind="error_rate", max=0.05), counts, None).passed
    assert _metric_probe(Probe(name="t", kind="ttft_p99_ms", max=100), counts, 99.0).passed
    assert not _metric_probe(Probe(name="t", kind="ttft_p99_ms", max=100), counts, None).passed
    assert _metric_probe(Probe(name="r", kind="rejected_min", max=3), counts, None).passed
    assert not _metric_probe(Probe(name="r", kind="rejected_min", max=4), counts, None).passed


def _report(tmp_path: Path) -> DrillReport:
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


def test_downtime_sums_the_intervals_a_worker_was_not_up(tmp_path: Path) -> None:
    """A worker down from 1.2 s to 2.7 s was down 1.5 s."""
    assert _report(tmp_path).downtime() == {"w2": 1.5}


def test_write_report_writes_json_markdown_and_png(tmp_path: Path) -> None:
    """report.json, report.md and a PNG timeline are written; the JSON holds the counts."""
    pytest.importorskip("matplotlib")
    report = write_report(_report(tmp_path))
    assert report.files == ("report.json", "report.md", "timeline.png")
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["requests"]["migrated"] == 1
    assert doc["passed"] is True
    assert doc["timeline"][0]["label"] == "kill w2"
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert "![timeline](timeline.png)" in md
    assert "| 4 | 0 | 1 | 0 | 0 | 0 |" in md


def test_summary_names_verdict_counts_and_report_path(tmp_path: Path) -> None:
    """The one-screen summary states the verdict, the counts and where the report is."""
    report = write_report(_report(tmp_path), plot=False)
    text = "\n".join(report.summary_lines())
    assert "PASSED" in text
    assert "sent 4, failed 0, migrated 1" in text
    assert f"report: {tmp_path}/report.md" in text
    assert "kill w2" in render_markdown(report)


def test_loads_counts_per_priority_and_admitted_error_rate() -> None:
    """Several profiles: totals plus sent/failed/shed per priority; sheds (with Retry-After)
    are failures but not failures of admitted requests."""
    from dynamo_ftctl.faults.drill import loads_counts
    from dynamo_ftctl.faults.scenario import LoadProfile

    shed = RequestRecord(index=9, target="t", planned=1.0, sent=1.0, done=1.1, first_token=None,
                         output_tokens=0, itl=(), status=503, outcome="5xx_503",
                         retry_after_s=1.0)
    premium = [_record(0, 32), _record(1, 32)]
    best = [_record(2, 64), shed, _record(3, 10, outcome="broken_stream", status=200)]
    counts = loads_counts([
        (LoadProfile(priority="premium", max_tokens=32), _Report(premium)),  # type: ignore[list-item]
        (LoadProfile(priority="best_effort", max_tokens=64), _Report(best)),  # type: ignore[list-item]
    ])
    assert counts["sent"] == 5
    assert counts["by_priority"]["premium"] == {**counts["by_priority"]["premium"],
                                                "sent": 2, "failed": 0, "rejected": 0}
    tier = counts["by_priority"]["best_effort"]
    assert (tier["sent"], tier["failed"], tier["rejected"], tier["shed_with_retry_after"]) == (
        3, 2, 1, 1)
    assert tier["admitted_error_rate"] == 0.5
    probe = Probe(name="p", kind="admitted_error_rate", priority="best_effort", max=0)
    assert not _metric_probe(probe, counts, None).passed
    assert _metric_probe(probe.model_copy(update={"priority": "premium"}), counts, None).passed
    missing = probe.model_copy(update={"priority": "standard"})
    assert "no standard load" in _metric_probe(missing, counts, None).detail


@pytest.mark.parametrize(("text", "where"), [
    (GOOD.replace("kind: workers_healthy}", "kind: shed, priority: best_effort}"),
     "s.yaml:5: hypothesis.probes[0].kind"),
    (GOOD.replace("method:\n", "method:\n  load: {rate: 1}\n  loads: [{rate: 1}]\n"),
     "s.yaml:8: method.loads"),
    (GOOD.replace("timeline:\n", "timeline:\n    - {at_s: 0, probe: {name: s, kind: shed}}\n"),
     "s.yaml:8: method.timeline[0].probe.priority"),
])
def test_overload_scenario_errors_name_file_line_and_key(tmp_path: Path, text: str,
                                                         where: str) -> None:
    """A shed probe in the hypothesis, load and loads together, a shed probe without a
    priority: each is a file:line: key error."""
    with pytest.raises(InventoryError) as info:
        load_scenario(_write(tmp_path, text))
    assert where in str(info.value)


def test_markdown_shows_per_priority_counts(tmp_path: Path) -> None:
    """report.md has a row per priority with sent, completed, failed and shed."""
    report = _report(tmp_path)
    tier = {"sent": 10, "completed": 6, "failed": 4, "rejected": 4, "shed_with_retry_after": 4,
            "error_rate": 0.4}
    counts = {**report.counts, "by_priority": {"best_effort": tier}}
    md = render_markdown(DrillReport(**{**report.__dict__, "counts": counts}))
    assert "| best_effort | 10 | 6 | 4 | 4 | 4 | 0.400 |" in md


def test_cut_streams_count_moved_streams_and_those_that_continued_intact(tmp_path: Path) -> None:
    """Moved load streams are intact only with all their tokens; witnesses only with the
    fault-free run's ids; the summary, report.md and report.json say both numbers."""
    from dynamo_ftctl.faults.drill import cut_streams
    from dynamo_ftctl.faults.scenario import LoadProfile

    records = [_record(0, 48, migrated=1), _record(1, 40, migrated=1), _record(2, 48),
               _record(3, 0, outcome="broken_stream", migrated=1)]
    witness = {"cut": 21, "cut_intact": 20, "cut_failed": 1}
    cut = cut_streams([(LoadProfile(max_tokens=48), _Report(records))],  # type: ignore[list-item]
                      witness)
    assert cut == {"streams": 25, "continued_intact": 21, "witness": 22,
                   "witness_token_identical": 20, "load": 3, "load_complete": 1}
    base = _report(tmp_path)
    report = write_report(DrillReport(**{**base.__dict__, "counts": {**base.counts, "cut": cut}}),
                          plot=False)
    line = ("streams cut mid-generation: 25, continued intact: 21 (20 of 22 witness streams "
            "token-identical to an uninterrupted run; 1 of 3 load streams complete with every "
            "token)")
    assert f"  {line}" in report.summary_lines()
    assert line.capitalize() in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["cut_streams"] == cut
