"""`ftctl canary record` on a terminal shows its progress; piped it shows none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from tests.terminal import run_on_a_terminal

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SPINNER = {chr(c) for c in range(0x2800, 0x2900)}  # rich's default spinner is braille


def _inventory(worker: SimWorker, path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "cluster": "tty", "workers": [{"name": "w1", "url": worker.url,
                                       "model": "ftctl-sim-tiny"}]}))
    return path


def _args(inventory: Path, out: Path) -> list[str]:
    # 8 repeats of each prompt at 64 tokens: a few seconds, long enough to draw frames.
    return [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "canary", "record",
            "-w", "w1", "-o", str(out), "--repeats", "8", "--max-tokens", "64"]


def test_record_on_a_terminal_shows_progress(sim_worker: SimWorker, tmp_path: Path) -> None:
    """On a terminal: the live line (spinner, text, n/total) appears on stderr, then the result."""
    out = tmp_path / "set.yaml"
    code, seen = run_on_a_terminal(_args(_inventory(sim_worker, tmp_path / "inv.yaml"), out),
                                   cwd=ROOT, deadline_s=120)
    assert code == 0, seen
    assert "recording the canary set" in seen, seen
    assert SPINNER & set(seen), seen
    assert "/24" in seen, seen  # 3 prompts x 8 repeats, counted as they are asked
    assert out.exists()


def test_record_piped_shows_no_progress(sim_worker: SimWorker, tmp_path: Path) -> None:
    """Piped: no spinner, no control sequences, no progress text on stderr."""
    out = tmp_path / "set.yaml"
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    done = subprocess.run(_args(_inventory(sim_worker, tmp_path / "inv.yaml"), out),
                          capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
                          env={**env, "TERM": "xterm-256color", "FTCTL_NO_CACHE": "1"})
    assert done.returncode == 0, done.stderr
    both = done.stdout + done.stderr
    assert "\x1b" not in both
    assert "\r" not in both
    assert not SPINNER & set(both)
    assert "recording the canary set" not in both
    assert out.exists()
