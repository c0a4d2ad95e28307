"""The EMA latency baseline and its state file (shared by concurrent one-shot probes)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from dynamo_ftctl.health.baseline import (
    MIN_SAMPLES,
    Baselines,
    BaselineStore,
    default_state_file,
)


def test_no_verdict_before_min_samples() -> None:
    """A baseline built from fewer than MIN_SAMPLES probes never calls a spike."""
    baselines = Baselines()
    for _ in range(MIN_SAMPLES - 1):
        baselines.update("w", 0.1, 0.1)
    assert not baselines.judge("w", 10.0, 3.0).spike


def test_ema_and_spike() -> None:
    """EMA follows alpha; a probe past factor x baseline (and 50 ms slower) is a spike."""
    baselines = Baselines()
    baselines.update("w", 0.1, 0.5)
    baselines.update("w", 0.2, 0.5)
    assert baselines.entries["w"].ema_s == pytest.approx(0.15)
    baselines.update("w", 0.15, 0.5)
    assert not baselines.judge("w", 0.4, 3.0).spike
    verdict = baselines.judge("w", 0.5, 3.0)
    assert verdict.spike
    assert "3.3x" in verdict.reason


def test_tiny_baseline_needs_an_absolute_margin() -> None:
    """Tripling a 5 ms loopback probe (15 ms) is jitter, not a spike."""
    baselines = Baselines()
    for _ in range(MIN_SAMPLES):
        baselines.update("w", 0.005, 0.1)
    assert not baselines.judge("w", 0.02, 3.0).spike


def test_default_state_file_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default file lives under $XDG_STATE_HOME/ftctl."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_file() == tmp_path / "ftctl" / "canary.json"


def test_store_round_trip_and_damaged_file(tmp_path: Path) -> None:
    """The store persists entries; a damaged file is treated as empty, then rewritten."""
    store = BaselineStore(tmp_path / "s" / "canary.json")
    with store.locked() as baselines:
        baselines.update("w", 0.2, 0.1)
    assert store.load().entries["w"].samples == 1
    store.path.write_text("{not json")
    assert store.load().entries == {}
    with store.locked() as baselines:
        baselines.update("w", 0.2, 0.1)
    assert json.loads(store.path.read_text())["workers"]["w"]["samples"] == 1


def _hammer(path: str, worker: str, count: int) -> None:
    store = BaselineStore(Path(path))
    for _ in range(count):
        with store.locked() as baselines:
            baselines.update(worker, 0.1, 0.1)


def test_concurrent_probes_do_not_lose_updates(tmp_path: Path) -> None:
    """Four processes updating one file 50 times each leave 200 samples, valid JSON."""
    path = tmp_path / "canary.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(str(path), "w", 50)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert BaselineStore(path).load().entries["w"].samples == 200
