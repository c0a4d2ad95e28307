"""Two `ftctl canary --watch` daemons over one fleet: one acts, the other takes over.

Both probe every worker and serve `/workers`; only the holder of `canary.acting_lock`
runs the actions (here a command appending "worker state" to a file). SIGKILL of the
actor hands the lock to the other at once; no worker is acted on twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import fetch
from tests.integration.health.test_daemon_sim import ROOT, read_line
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

pytestmark = pytest.mark.integration

ACTION = ("import os; open(os.environ['MARK'], 'a').write("
          "os.environ['FTCTL_WORKER'] + ' ' + os.environ['FTCTL_STATE'] + '\\n')")


def workers_doc(url: str) -> dict[str, Any]:
    return dict(fetch.get(f"{url}/workers", timeout=5).json())


def state_of(url: str, worker: str) -> str:
    return next(w["state"] for w in workers_doc(url)["workers"] if w["name"] == worker)


def acted(marker: Path) -> list[str]:
    return marker.read_text().splitlines() if marker.exists() else []


@pytest.fixture
def fleet(sim_worker_factory: SimWorkerFactory, tmp_path: Path,
          ) -> Iterator[tuple[dict[str, Any], Callable[[str], tuple[str, Any]], Path]]:
    """Three sim workers, an inventory naming an acting lock, and a daemon starter."""
    workers = {name: sim_worker_factory(name=name) for name in ("w1", "w2", "w3")}
    marker = tmp_path / "acted.txt"
    procs: list[subprocess.Popen[str]] = []

    def start(name: str) -> tuple[str, subprocess.Popen[str]]:
        inventory = {
            "cluster": "t",
            "workers": [{"name": n, "url": w.url, "model": "ftctl-sim-tiny"}
                        for n, w in workers.items()],
            "canary": {
                "interval_s": 0.5, "timeout_s": 1.0, "max_retries": 0,
                "set": str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"),
                "state_file": str(tmp_path / f"{name}-state.json"),
                "acting_lock": str(tmp_path / "shared" / "acting.lock"),
                "actions": [{"on": ["unhealthy"], "command": [sys.executable, "-c", ACTION]}],
            },
        }
        inv = tmp_path / f"{name}.yaml"
        inv.write_text(json.dumps(inventory))
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", "-i", str(inv), "canary", "--watch",
             "--json", "--listen", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "MARK": str(marker)})
        procs.append(proc)
        line = read_line(proc.stderr, proc, 60)
        return line.strip().rsplit(" ", 1)[-1], proc

    (tmp_path / "shared").mkdir()
    try:
        yield workers, start, marker
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stderr is not None:
                proc.stderr.close()


def test_one_daemon_acts_and_the_other_takes_over_without_acting_twice(fleet: Any) -> None:
    """A acts, B only watches; w2 killed: drained once (by A); A SIGKILLed: B acts within a
    second and does not drain w2 again; w3 killed: drained once (by B)."""
    workers, start, marker = fleet
    a_url, a_proc = start("a")
    wait_until(lambda: workers_doc(a_url)["acting"], 30, "daemon A acting")
    b_url, _ = start("b")
    wait_until(lambda: all(w["last"] for w in workers_doc(b_url)["workers"]), 30,
             "daemon B's first round")
    assert workers_doc(b_url)["acting"] is False

    workers["w2"].kill()
    wait_until(lambda: acted(marker) == ["w2 unhealthy"], 30, "A draining w2")
    wait_until(lambda: state_of(b_url, "w2") == "unhealthy", 30, "B seeing w2 unhealthy")
    assert acted(marker) == ["w2 unhealthy"]  # B saw it too and did not act

    killed = time.monotonic()
    a_proc.send_signal(signal.SIGKILL)
    wait_until(lambda: workers_doc(b_url)["acting"], 30, "daemon B acting")
    took = time.monotonic() - killed
    print(f"\ntakeover: B acting {(time.monotonic() - killed) * 1000:.0f} ms after A's SIGKILL")
    assert took < 10  # the bound stated in docs/canary.md is 1 s on an idle machine

    workers["w3"].kill()
    wait_until(lambda: "w3 unhealthy" in acted(marker), 30, "B draining w3")
    assert sorted(acted(marker)) == ["w2 unhealthy", "w3 unhealthy"]


def test_a_new_actor_catches_up_on_what_nobody_acted_on(fleet: Any, tmp_path: Path) -> None:
    """A worker that went unhealthy while no daemon acted (the only actor was stopped) is
    acted on once by the daemon that takes the lock next."""
    workers, start, marker = fleet
    a_url, a_proc = start("a")
    wait_until(lambda: workers_doc(a_url)["acting"], 30, "daemon A acting")
    b_url, _ = start("b")
    a_proc.send_signal(signal.SIGSTOP)  # holds the lock, acts on nothing
    try:
        workers["w1"].kill()
        wait_until(lambda: state_of(b_url, "w1") == "unhealthy", 30, "B seeing w1 unhealthy")
        assert acted(marker) == []
        a_proc.send_signal(signal.SIGKILL)
        wait_until(lambda: acted(marker) == ["w1 unhealthy"], 30, "B catching up on w1")
    finally:
        a_proc.send_signal(signal.SIGCONT)
    record = json.loads((tmp_path / "shared" / "acting.lock.acted").read_text())
    assert record["w1"] == "unhealthy"
