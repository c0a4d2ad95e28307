"""deploy/prometheus/alerts.yml: valid for promtool, its unit tests pass, only metrics.py names."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dynamo_ftctl.metrics import METRIC_NAMES

ALERTS = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ALERTS.with_name("alerts_test.yml")
_NAME = re.compile(r"\b((?:dynamo|ftctl)_[a-z_]+)\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; `make test` installs it)")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_promtool_accepts_the_rules() -> None:
    """`promtool check rules` passes on the shipped alert rules."""
    proc = _promtool("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_alerts_fire_when_their_series_are_gone() -> None:
    """`promtool test rules`: a lock whose holders vanished, no lock series at all, and a
    dead canary daemon each raise their alert (the unit tests in alerts_test.yml)."""
    proc = _promtool("test", "rules", str(ALERT_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_absent_series_cases_are_covered() -> None:
    """The unit tests exercise each alert whose failure is a missing series."""
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    tested = {case["alertname"] for group in doc["tests"]
              for case in group["alert_rule_test"] if case["exp_alerts"]}
    assert {"FailoverLockUnheld", "FailoverLockMetricsAbsent",
            "CanaryDaemonNotProbing"} <= tested


def test_operating_alerts_are_covered() -> None:
    """The unit tests raise the alerts an operator of a real cluster needs (issue 32): too
    few healthy workers, an open breaker, a query of death, failed migrations, a proxy
    that cannot read its daemon."""
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    tested = {case["alertname"] for group in doc["tests"]
              for case in group["alert_rule_test"] if case["exp_alerts"]}
    assert {"FleetCapacityLow", "CircuitBreakerOpen", "QueriesOfDeath", "MigrationsFailing",
            "ProxyCannotReadDaemon"} <= tested


def test_rules_use_only_defined_metrics() -> None:
    """Every metric in an expression is one metrics.py defines; the canary ones are covered."""
    doc = yaml.safe_load(ALERTS.read_text())
    used: set[str] = set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            for name in _NAME.findall(rule["expr"]):
                base = next((name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), name)
                used.add(base if base in METRIC_NAMES else name)
    assert used <= METRIC_NAMES, used - METRIC_NAMES
    assert {"ftctl_worker_state", "ftctl_circuit_breaker_state",
            "ftctl_canary_probe_duration_seconds", "ftctl_lock_holder"} <= used
