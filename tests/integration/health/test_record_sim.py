"""`ftctl canary record` against freshly started `ftctl sim` workers that warm up slowly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from dynamo_ftctl.health.canaryset import load_canary_set

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "canaries" / "ftctl-sim-tiny.yaml"
WARMUP_S = 3.0  # longer than the inventory's per-request timeout below
TIMEOUT_S = 1.0


def record(inventory: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run `ftctl canary record -w w1` as the user would."""
    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "canary", "record",
         "-w", "w1", "-o", str(out), *extra],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1"},
    )


def inventory_for(url: str, path: Path) -> Path:
    """An inventory of one worker with a per-request canary timeout shorter than its warm-up."""
    path.write_text(yaml.safe_dump({
        "cluster": "rec", "canary": {"timeout_s": TIMEOUT_S},
        "workers": [{"name": "w1", "url": url, "model": "ftctl-sim-tiny"}],
    }))
    return path


def test_record_waits_for_warm_up_then_records(
    sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """A cold worker's slow first request is the warm-up; the set records, same as shipped."""
    worker = sim_worker_factory(name="cold", warmup_s=WARMUP_S)
    out = tmp_path / "set.yaml"
    proc = record(inventory_for(worker.url, tmp_path / "inv.yaml"), out)
    assert proc.returncode == 0, proc.stderr
    assert "warm up" in proc.stderr
    recorded, shipped = load_canary_set(out), load_canary_set(SHIPPED)
    assert [(p.name, p.expected_token_ids, p.expected_text) for p in recorded.prompts] == [
        (p.name, p.expected_token_ids, p.expected_text) for p in shipped.prompts]


def test_without_warm_up_a_cold_worker_times_out(
    sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """`--warmup-timeout 0` meets the cold worker with the normal timeout: exit 3."""
    worker = sim_worker_factory(name="cold", warmup_s=WARMUP_S)
    proc = record(inventory_for(worker.url, tmp_path / "inv.yaml"), tmp_path / "set.yaml",
                  "--warmup-timeout", "0")
    assert proc.returncode == 3, proc.stderr
    assert "warm up" not in proc.stderr
