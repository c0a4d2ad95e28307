"""The launcher's stop paths, on the process seam's fake: TERM first, KILL at the deadline."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, cast

from dynamo_ftctl.engine.launcher import LocalCluster, SimWorker
from dynamo_ftctl.process import FakeSpawner


def _worker(fake: FakeSpawner, name: str, tmp_path: Path) -> SimWorker:
    pid_file = tmp_path / f"{name}.pid"
    child = fake.spawn(["python", "-m", "dynamo_ftctl", "sim", "serve"], group=True)
    pid_file.write_text(f"{child.pid}\n")
    return SimWorker(name, child, tmp_path / f"{name}.log", pid_file, None, own_log=False)


def test_a_worker_that_honours_term_is_not_killed_and_its_pid_file_goes(tmp_path: Path) -> None:
    """stop: SIGTERM to the worker's group ends it; its pid file is removed; exit code kept."""
    fake = FakeSpawner()
    worker = _worker(fake, "w0", tmp_path)
    assert worker.stop(timeout_s=4.0) == -signal.SIGTERM
    assert fake.spawned[0].sent[:2] == [signal.SIGCONT, signal.SIGTERM]
    assert fake.spawned[0].waits[0] == 4.0
    assert not (tmp_path / "w0.pid").exists()


def test_a_cluster_stop_terminates_every_worker_before_killing_any(tmp_path: Path) -> None:
    """LocalCluster.stop: all workers get SIGTERM at once (one shared deadline), then the
    ones that ignored it get SIGKILL."""
    fake = FakeSpawner(exits_on={})  # hung engines: SIGTERM does nothing
    workers = {name: _worker(fake, name, tmp_path) for name in ("w0", "w1")}
    LocalCluster(cast(Any, None), tmp_path, workers).stop(timeout_s=1.0)
    terms = [i for i, (_, s) in enumerate(fake.signals) if s == signal.SIGTERM]
    kills = [i for i, (_, s) in enumerate(fake.signals) if s == signal.SIGKILL]
    assert len(terms) == 2
    assert kills
    assert max(terms) < min(kills)
    assert all(not w.alive for w in workers.values())
    assert not list(tmp_path.glob("*.pid"))
