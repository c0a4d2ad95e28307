"""`ftctl load --metrics-url` against a real `ftctl sim` engine's /metrics."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_load_reports_the_engines_own_counters(sim_worker, tmp_path: Path):
    """The sim's `vllm:request_success_total` rises by the requests sent, in --json and in
    summary.json; a metrics URL nobody answers is reported and the run still exits 0."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "load", "--url", sim_worker.url,
         "--requests", "5", "--rate", "20", "--arrival", "constant", "--max-tokens", "4",
         "--metrics-url", sim_worker.url, "--metrics-url", dead, "--json",
         "--out", str(out), "--no-plot"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["completed"] == 5
    sim, refused = doc["server_metrics"]
    assert sim["url"] == f"{sim_worker.url}/metrics"
    assert sim["error"] is None
    by_name = {c["name"]: c for c in sim["counters"]}
    assert by_name["vllm:request_success_total"]["delta"] == 5
    assert by_name["vllm:request_success_total"]["source"] == "vllm"
    assert refused["error"].startswith("before: unreachable")
    assert refused["counters"] == []
    assert doc["server_migrated"] is None  # a vLLM-like engine counts no migrations
    saved = json.loads((out / "summary.json").read_text())
    assert saved["server_metrics"] == doc["server_metrics"]


def test_load_table_shows_the_server_counters(sim_worker):
    """Without --json the text report has the server counters' table."""
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "load", "--url", sim_worker.url,
         "--requests", "2", "--rate", "20", "--max-tokens", "2",
         "--metrics-url", sim_worker.url],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "vllm:request_success_total" in proc.stdout
    assert "migrated (server counters)" in proc.stdout


def test_sim_exports_no_created_series(sim_worker):
    """The sim's /metrics, like every ftctl process's, has no `_created` series."""
    from dynamo_ftctl.http1 import fetch_blocking

    status, body = fetch_blocking("GET", f"{sim_worker.url}/metrics", timeout_s=10)
    assert status == 200
    assert b"vllm:request_success" in body
    assert b"_created" not in body
