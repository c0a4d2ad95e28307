"""`ftctl canary --watch` as a real process over real `ftctl sim` workers."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import fetch
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
DAEMON_TOKEN = "daemon-test-token"


def read_line(stream: Any, proc: subprocess.Popen[str], timeout_s: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)

    def line_ready() -> bool:
        if selector.select(timeout=0.1):
            return True
        assert proc.poll() is None, (
            f"daemon exited with {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
        return False

    try:
        wait_until(line_ready, timeout_s, "the daemon's first line", interval=0)
        return str(stream.readline())
    finally:
        selector.close()


@pytest.fixture
def daemon(sim_worker_factory: SimWorkerFactory, tmp_path: Path,
           ) -> Iterator[tuple[str, subprocess.Popen[str], dict[str, Any], Path]]:
    workers = {name: sim_worker_factory(name=name) for name in ("w1", "w2")}
    marker = tmp_path / "actions.txt"
    action = ("import os; open(os.environ['MARK'], 'a').write("
              "os.environ['FTCTL_WORKER'] + ' ' + os.environ['FTCTL_STATE'] + '\\n')")
    inventory = {
        "cluster": "t",
        "workers": [{"name": n, "url": w.url, "model": "ftctl-sim-tiny"}
                    for n, w in workers.items()],
        "canary": {
            "interval_s": 1.0, "timeout_s": 1.0, "max_retries": 0,
            "set": str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"),
            "state_file": str(tmp_path / "state.json"),
            "transition_log": str(tmp_path / "transitions.jsonl"),
            "actions": [{"on": ["unhealthy"], "command": [sys.executable, "-c", action]}],
        },
    }
    inv = tmp_path / "inv.yaml"
    inv.write_text(json.dumps(inventory))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inv), "canary", "--watch", "--json",
         "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "MARK": str(marker), "FTCTL_DAEMON_TOKEN": DAEMON_TOKEN},
    )
    try:
        line = read_line(proc.stderr, proc, 60)
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        yield url, proc, workers, marker
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def states(url: str) -> dict[str, str]:
    doc = fetch.get(f"{url}/workers", timeout=5).json()
    return {w["name"]: w["state"] for w in doc["workers"]}


def probed(url: str) -> bool:
    doc = fetch.get(f"{url}/workers", timeout=5).json()
    return all(w["last"] is not None for w in doc["workers"])


def test_killed_worker_goes_unhealthy_fast_on_a_passive_report(daemon: Any) -> None:
    """SIGKILL + the proxy's report: UNHEALTHY well inside a second, action run, all logged."""
    url, proc, workers, marker = daemon
    wait_until(lambda: probed(url), 30, "the first round")
    assert states(url) == {"w1": "healthy", "w2": "healthy"}
    workers["w2"].kill()
    assert workers["w2"].wait_exit(10) is not None
    report = {"worker": "w2", "ok": False, "reason": "stream broke", "source": "proxy"}
    assert fetch.post(f"{url}/report", timeout=5, json=report).status == 401
    response = fetch.post(f"{url}/report", timeout=5, json=report,
                          headers={"Authorization": f"Bearer {DAEMON_TOKEN}"})
    assert response.status == 200
    wait_until(lambda: states(url), 5, "w2 unhealthy", accept=lambda s: s["w2"] == "unhealthy")
    assert states(url)["w1"] == "healthy"
    wait_until(lambda: marker.exists() and "w2 unhealthy" in marker.read_text(), 10, "the action")
    metrics = fetch.get(f"{url}/metrics", timeout=5).text
    assert 'ftctl_worker_state{state="unhealthy",worker="w2"} 1.0' in metrics
    assert 'ftctl_circuit_breaker_state{worker="w2"} 1.0' in metrics
    assert "ftctl_canary_probe_duration_seconds_bucket" in metrics
    assert fetch.get(f"{url}/health", timeout=5).json()["status"] == "ok"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    lines = [json.loads(line) for line in proc.stdout.read().splitlines()]
    moves = [(r["worker"], r["state"]) for r in lines if r.get("event") == "transition"]
    assert moves == [("w2", "suspicious"), ("w2", "unhealthy")]
    assert any(r.get("event") == "action" and r["ok"] for r in lines)
    logged = (marker.parent / "transitions.jsonl").read_text().splitlines()
    assert [json.loads(x)["state"] for x in logged] == ["suspicious", "unhealthy"]
    assert json.loads((marker.parent / "state.json").read_text())["workers"]["w1"]["samples"] >= 1


def test_probes_alone_find_a_corrupting_worker(daemon: Any) -> None:
    """No report needed: an sdc worker is UNHEALTHY within an interval plus its probes."""
    url, _, workers, _ = daemon
    wait_until(lambda: probed(url), 30, "the first round")
    worker = workers["w1"]
    played = fetch.post(f"{worker.url}/admin/fault", json={"kind": "sdc"}, timeout=5,
                        headers={"Authorization": f"Bearer {worker.admin_token}"})
    assert played.status == 200, played.text
    wait_until(lambda: states(url), 10, "w1 unhealthy", accept=lambda s: s["w1"] == "unhealthy")
    doc = fetch.get(f"{url}/workers", timeout=5).json()
    w1 = next(w for w in doc["workers"] if w["name"] == "w1")
    assert w1["weight"] == 0.0
    assert w1["last"]["kind"] == "token_mismatch"


def test_sighup_does_not_end_the_daemon(daemon: Any) -> None:
    """Issue 29: SIGHUP (a closed terminal, a log rotation) killed the daemon; it goes on
    probing and answering, and says so once."""
    url, proc, _, _ = daemon
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: states(url), 30, "healthy workers",
               accept=lambda s: s == {"w1": "healthy", "w2": "healthy"})
    assert proc.poll() is None
