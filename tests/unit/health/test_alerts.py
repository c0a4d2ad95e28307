"""deploy/prometheus/alerts.yml: valid for promtool, and only metric names from metrics.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dynamo_ftctl.metrics import METRIC_NAMES

ALERTS = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "alerts.yml"
_NAME = re.compile(r"\b((?:dynamo|ftctl)_[a-z_]+)\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def test_promtool_accepts_the_rules() -> None:
    """`promtool check rules` passes on the shipped alert rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; `make test` installs it)")
    proc = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


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
    assert {"dynamo_worker_status", "dynamo_circuit_breaker_state",
            "dynamo_health_check_duration_seconds"} <= used
