"""`ftctl load` parsing and `ftctl load compare` on saved reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from dynamo_ftctl.cli.main import app
from dynamo_ftctl.loadgen.compare import compare_reports


def _report(path: Path, **numbers) -> Path:
    doc = {"kind": "ftctl-load-report", "requests_per_s": 100.0, "completed": 100,
           "failed": 0, "error_rate": 0.0, "ttft_ms": {"p50": 10.0, "p99": 20.0},
           "errors_by_class": {}}
    doc.update(numbers)
    path.write_text(json.dumps(doc))
    return path


def test_compare_reports_says_better_and_worse(tmp_path: Path):
    """Higher throughput is better, higher latency worse; errors are diffed by class."""
    a = _report(tmp_path / "a.json")
    b = _report(tmp_path / "b.json", requests_per_s=150.0, ttft_ms={"p50": 10.0, "p99": 40.0},
                errors_by_class={"5xx_503": 2})
    result = compare_reports(a, b)
    by_name = {m.metric: m for m in result.metrics}
    assert by_name["requests_per_s"].change == 0.5
    assert by_name["requests_per_s"].better is True
    assert by_name["ttft_ms.p99"].better is False
    assert by_name["ttft_ms.p50"].better is None
    assert result.errors_by_class == {"5xx_503": (0, 2)}


def test_cli_compare_json(tmp_path: Path):
    """`ftctl load compare A B --json` prints the comparison as JSON."""
    a = _report(tmp_path / "a.json")
    b = _report(tmp_path / "b.json", requests_per_s=50.0)
    result = CliRunner().invoke(app, ["load", "compare", str(a), str(b), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["metrics"][0]["metric"] == "requests_per_s"
    assert doc["metrics"][0]["change"] == -0.5


def test_cli_compare_refuses_a_non_report(tmp_path: Path):
    """Comparing a file that is not a load report exits 2 naming the file."""
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "load", "compare",
                           str(bad), str(bad)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2
    assert str(bad) in proc.stderr


def test_cli_bad_flags_exit_2():
    """A bad duration, no target, rate and users together, an unknown client, a shard out of
    range, a start time without a zone, fewer users than processes, a sweep in several
    processes: one error line, exit 2 (http1 takes https targets: no longer refused)."""
    for args in (["--url", "http://x:1", "--rate", "5", "--duration", "5x"],
                 ["--rate", "5", "--requests", "3"],
                 ["--url", "http://x:1", "--rate", "5", "--users", "2", "--requests", "3"],
                 ["--url", "http://x:1", "--rate", "5", "--requests", "3", "--client", "h3"],
                 ["--url", "http://x:1", "--rate", "5", "--requests", "3", "--shard", "2/2"],
                 ["--url", "http://x:1", "--rate", "5", "--requests", "3", "--start-at",
                  "2026-01-01T00:00:00"],
                 ["--url", "http://x:1", "--users", "1", "--requests", "3", "--procs", "2"],
                 ["--url", "http://x:1", "--rate", "5", "--requests", "3", "--procs", "2",
                  "--sweep", "1:10"]):
        proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "load", *args],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("error:"), proc.stderr


def test_root_help_does_not_import_load_dependencies():
    """`ftctl --help` lists load without importing aiohttp or the load generator."""
    code = ("import sys; from dynamo_ftctl.cli.main import main; "
            "rc = main(['--help']); "
            "assert 'aiohttp' not in sys.modules and 'dynamo_ftctl.loadgen' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "load" in proc.stdout


def test_cli_merge_refuses_a_non_report(tmp_path: Path):
    """`ftctl load merge` on a directory without a report exits 2 and names the file."""
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "load", "merge",
                           str(tmp_path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2
    assert str(tmp_path / "summary.json") in proc.stderr
