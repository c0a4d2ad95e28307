"""The generator against a controllable loopback server: rates, stalls, errors, sweeps, CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_ftctl.loadgen import (
    Length,
    LoadConfig,
    Schedule,
    Slo,
    Workload,
    run_load,
    sweep_rate,
)

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_achieved_rate_matches_planned_rate(start_target):
    """A constant 200 req/s for 2 s sends 400 requests and completes them at about 200/s."""
    url = start_target()
    report = run_load(LoadConfig(targets=(url,),
                                 schedule=Schedule(rate=200, arrival="constant"),
                                 workload=Workload(max_tokens=Length.fixed(4)),
                                 duration_s=2.0))
    s = report.summary
    assert s.planned_requests == 400
    assert s.completed == 400
    assert s.failed == 0
    assert 180 <= s.requests_per_s <= 210
    planned = [r.planned for r in report.records]
    assert planned[-1] == pytest.approx(399 / 200)


def test_open_loop_latency_shows_a_stall(start_target):
    """A 2 s server stall shows in open-loop latencies: requests planned during it wait."""
    url = start_target("--stall-after", "50", "--stall", "2")
    report = run_load(LoadConfig(targets=(url,),
                                 schedule=Schedule(rate=100, arrival="constant"),
                                 workload=Workload(max_tokens=Length.fixed(4)),
                                 duration_s=4.0))
    s = report.summary
    assert s.completed == 400
    assert s.e2e_ms.p90 > 1000
    assert s.e2e_ms.max > 1800


def test_closed_loop_hides_the_same_stall(start_target):
    """The same stall barely moves a closed loop's p99: one user waits once (coordinated omission)."""
    url = start_target("--stall-after", "50", "--stall", "2")
    report = run_load(LoadConfig(targets=(url,), schedule=Schedule(users=1),
                                 workload=Workload(max_tokens=Length.fixed(4)),
                                 duration_s=4.0))
    s = report.summary
    assert s.e2e_ms.max > 1800  # the stall happened ...
    assert s.completed > 200
    assert s.e2e_ms.p99 < 200  # ... but one slow request out of hundreds hides in p99


def test_capped_open_loop_measures_from_the_planned_time(start_target):
    """With one request in flight at most, latency from the planned time shows the stall
    while latency from the actual send does not."""
    url = start_target("--stall-after", "50", "--stall", "2")
    report = run_load(LoadConfig(targets=(url,),
                                 schedule=Schedule(rate=100, arrival="constant", concurrency=1),
                                 workload=Workload(max_tokens=Length.fixed(4)),
                                 duration_s=4.0))
    s = report.summary
    assert s.completed == 400
    assert s.e2e_ms.p90 > 1000
    assert s.queue_ms.p90 > 1000
    assert s.e2e_from_sent_ms.p99 < 200


def test_error_classes_are_counted(start_target):
    """Scripted 503, 429, broken streams and migrated answers land in their classes."""
    url = start_target("--script", "ok,503,429,break,migrated")
    report = run_load(LoadConfig(targets=(url,), schedule=Schedule(users=4),
                                 workload=Workload(stream=True, max_tokens=Length.fixed(8)),
                                 requests=50))
    s = report.summary
    assert s.errors_by_class == {"4xx_429": 10, "5xx_503": 10, "broken_stream": 10}
    assert s.completed == 20
    assert s.migrated == 10
    assert s.failed == 30
    ok = [r for r in report.records if r.outcome == "ok"]
    assert all(r.output_tokens == 8 and len(r.itl) == 7 for r in ok)


def test_the_client_reads_migrations_and_retry_after(start_target):
    """The client counts a header migration and a trailing-comment one (`ftctl proxy` after
    a mid-stream move) as migrated, and keeps Retry-After of shed answers only."""
    url = start_target("--script", "ok,migrated,migrated-late,503,429,529,500")
    report = run_load(LoadConfig(targets=(url,), schedule=Schedule(users=2), client="http1",
                                 workload=Workload(stream=True, max_tokens=Length.fixed(4)),
                                 requests=14))
    s = report.summary
    assert s.errors_by_class == {"4xx_429": 2, "5xx_503": 2, "5xx_529": 2, "5xx_500": 2}
    assert (s.completed, s.migrated, s.shed_with_retry_after) == (6, 4, 6)
    shed = sorted((r.status, r.retry_after_s) for r in report.records if not r.ok)
    assert shed == [(429, 2.0)] * 2 + [(500, None)] * 2 + [(503, 2.0)] * 2 + [(529, 2.0)] * 2
    assert report.to_json()["shed_with_retry_after"] == 6


def test_connect_and_timeout_classes(start_target):
    """A closed port counts as connect errors; a hanging answer as a timeout."""
    refused = run_load(LoadConfig(targets=(f"http://127.0.0.1:{_closed_port()}",),
                                  schedule=Schedule(users=2), requests=4))
    assert refused.summary.errors_by_class == {"connect": 4}
    url = start_target("--script", "ok,hang")
    hung = run_load(LoadConfig(targets=(url,), schedule=Schedule(users=4), requests=4,
                               timeout_s=0.5))
    assert hung.summary.errors_by_class == {"timeout": 2}
    assert hung.summary.completed == 2


def test_abort_on_error_rate(start_target):
    """A server failing every request stops the run once the error rate passes the limit."""
    url = start_target("--script", "500")
    report = run_load(LoadConfig(targets=(url,), schedule=Schedule(rate=200), duration_s=5.0,
                                 abort_error_rate=0.5, abort_min_requests=20))
    assert report.aborted is not None
    assert report.elapsed_s < 4.0
    assert 20 <= len(report.records) < 1000


def test_abort_on_error_rate_counts_every_process_of_the_run(start_target):
    """Under --procs 2 the limit is the run's: 30 failures a process never reach
    `abort_min_requests` 40 alone, the run's 60 do, and both processes stop."""
    from dynamo_ftctl.loadgen.processes import run_load_processes

    url = start_target("--script", "500")
    report = run_load_processes(
        LoadConfig(targets=(url,), schedule=Schedule(rate=40, arrival="constant"),
                   duration_s=1.5, abort_error_rate=0.5, abort_min_requests=40), 2)
    assert report.aborted is not None
    assert "error rate" in report.aborted
    assert 40 <= len(report.records) < 60  # the whole plan is 60


@pytest.mark.slow
def test_sweep_converges_on_known_capacity(start_target):
    """Against a server that serves 2 requests at a time in 20 ms (capacity ~100/s), the
    sweep's highest rate meeting TTFT p99 <= 150 ms lands near 100/s."""
    url = start_target("--capacity", "2", "--service", "0.02")
    config = LoadConfig(targets=(url,), schedule=Schedule(rate=10, arrival="constant"),
                        workload=Workload(max_tokens=Length.fixed(2)), duration_s=2.0,
                        slo=Slo(ttft_p99_ms=150))
    result = sweep_rate(config, low=20, high=400, precision=0.08, max_steps=8)
    assert result.best_rate_per_s is not None
    assert 60 <= result.best_rate_per_s <= 125
    assert result.lowest_failing_rate_per_s is not None
    assert result.lowest_failing_rate_per_s <= 180
    assert len(result.steps) <= 8


def test_cli_writes_summary_csv_jsonl_and_png(start_target, tmp_path: Path):
    """`ftctl load --json --out DIR` prints one JSON summary and writes the four files."""
    url = start_target("--itl", "0.001")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "load", "--url", url, "--rate", "50",
         "--requests", "20", "--max-tokens", "8", "--stream", "--out", str(out), "--json",
         "--spin-us", "200"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["completed"] == 20
    assert doc["ttft_ms"]["count"] == 20
    assert doc["itl_ms"]["count"] == 20 * 7
    assert (doc["config"]["spin_us"], doc["config"]["client"]) == (200, "auto")
    for key in ("requests_per_s", "failed", "e2e_ms", "errors_by_class"):
        assert key in doc
    assert json.loads((out / "summary.json").read_text())["completed"] == 20
    assert len((out / "requests.csv").read_text().splitlines()) == 21
    assert len((out / "requests.jsonl").read_text().splitlines()) == 20
    assert (out / "load.png").read_bytes().startswith(b"\x89PNG")


def test_cli_unreachable_target_exits_3():
    """Every request refused: the summary still prints and the exit code is 3."""
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "load", "--url",
         f"http://127.0.0.1:{_closed_port()}", "--rate", "20", "--requests", "3", "--json"],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 3
    assert json.loads(proc.stdout)["errors_by_class"] == {"connect": 3}
