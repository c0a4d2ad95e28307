"""`ftctl canary record` against freshly started `ftctl sim` workers that warm up slowly."""

from __future__ import annotations

import os
import resource
import signal
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


def record(inventory: Path, out: Path, *extra: str,
           fsize: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run `ftctl canary record -w w1` as the user would; `fsize` caps the size of the
    files it may write (a write past it fails with EFBIG, as on a full disk)."""
    def limit() -> None:
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "canary", "record",
         "-w", "w1", "-o", str(out), *extra],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1", "FTCTL_NO_CACHE": "1"}, preexec_fn=limit,
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


def test_an_out_that_cannot_be_made_is_one_line(
    sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """Recorded, but /proc takes no new file: exit 1 and one line naming the path."""
    worker = sim_worker_factory(name="w")
    out = Path("/proc") / f"ftctl-test-{os.getpid()}.yaml"
    proc = record(inventory_for(worker.url, tmp_path / "inv.yaml"), out, "--warmup-timeout", "0")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"error: {out}: cannot write: No such file or directory"]


def test_a_write_that_fails_keeps_the_previous_set(
    sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """A write cut short (EFBIG): exit 1, one line, the old set whole, no temporary file."""
    worker = sim_worker_factory(name="w")
    out = tmp_path / "sets" / "set.yaml"
    out.parent.mkdir()
    out.write_text("previous\n")
    proc = record(inventory_for(worker.url, tmp_path / "inv.yaml"), out, "--warmup-timeout", "0",
                  fsize=64)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"error: {out}: cannot write: File too large"]
    assert out.read_text() == "previous\n"
    assert [p.name for p in out.parent.iterdir()] == ["set.yaml"]
