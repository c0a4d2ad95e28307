"""A drill's report: downtime, the one-screen summary, report.json, report.md and the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo_ftctl.drill import DrillReport
from dynamo_ftctl.drill.report import render_markdown, write_report
from tests.unit.drill.samples import drill_report


def test_downtime_sums_the_intervals_a_worker_was_not_up(tmp_path: Path) -> None:
    """A worker down from 1.2 s to 2.7 s was down 1.5 s."""
    assert drill_report(tmp_path).downtime() == {"w2": 1.5}


def test_write_report_writes_json_markdown_and_png(tmp_path: Path) -> None:
    """report.json, report.md and a PNG timeline are written; the JSON holds the counts."""
    pytest.importorskip("matplotlib")
    report = write_report(drill_report(tmp_path))
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
    report = write_report(drill_report(tmp_path), plot=False)
    text = "\n".join(report.summary_lines())
    assert "PASSED" in text
    assert "sent 4, failed 0, migrated 1" in text
    assert f"report: {tmp_path}/report.md" in text
    assert "kill w2" in render_markdown(report)


def test_markdown_shows_per_priority_counts(tmp_path: Path) -> None:
    """report.md has a row per priority with sent, completed, failed and shed."""
    report = drill_report(tmp_path)
    tier = {"sent": 10, "completed": 6, "failed": 4, "rejected": 4, "shed_with_retry_after": 4,
            "error_rate": 0.4}
    counts = {**report.counts, "by_priority": {"best_effort": tier}}
    md = render_markdown(DrillReport(**{**report.__dict__, "counts": counts}))
    assert "| best_effort | 10 | 6 | 4 | 4 | 4 | 0.400 |" in md
