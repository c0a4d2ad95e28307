"""`ftctl canary` one-shot probes against real `ftctl sim` workers and a garbage server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dynamo_ftctl.health.baseline import MIN_SAMPLES
from tests import fetch
from tests.simfaults import hung
from tests.waiting import wait_until

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SET = ROOT / "canaries" / "ftctl-sim-tiny.yaml"


def canary(url: str, state: Path, *extra: str, timeout_s: float = 60,
           ) -> tuple[int, dict[str, Any], str, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "canary", "--url", url, "--set", str(SET),
         "--state-file", str(state), "--json", *extra],
        capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    elapsed = time.monotonic() - start
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, doc, proc.stderr, elapsed


def fault(worker: SimWorker, **body: Any) -> None:
    response = fetch.post(f"{worker.url}/admin/fault", json=body, timeout=5,
                          headers={"Authorization": f"Bearer {worker.admin_token}"})
    assert response.status == 200, response.text


def test_healthy_worker_exits_zero(sim_worker: SimWorker, tmp_path: Path) -> None:
    """A good worker passes every prompt: exit 0, per-prompt checks and the time taken."""
    rc, doc, _, _ = canary(sim_worker.url, tmp_path / "s.json")
    assert rc == 0
    result = doc["workers"][0]
    assert result["verdict"] == "healthy"
    assert all(c["kind"] == "ok" for c in result["checks"])
    assert doc["wall_s"] > 0


def test_sdc_is_a_token_mismatch(sim_worker: SimWorker, tmp_path: Path) -> None:
    """Silent data corruption: exit 1, token mismatch at a named position with both ids."""
    fault(sim_worker, kind="sdc")
    rc, doc, _, _ = canary(sim_worker.url, tmp_path / "s.json")
    assert rc == 1
    result = doc["workers"][0]
    assert result["kind"] == "token_mismatch"
    mismatch = result["mismatch"]
    assert mismatch["expected"] != mismatch["got"]
    assert f"position {mismatch['position']}" in result["reason"]


def test_slow_worker_is_a_latency_spike_after_a_baseline(
    sim_worker: SimWorker, tmp_path: Path,
) -> None:
    """Healthy probes build the EMA baseline; a slowed worker is then a spike (exit 1)."""
    state = tmp_path / "s.json"
    for _ in range(MIN_SAMPLES):
        assert canary(sim_worker.url, state)[0] == 0
    fault(sim_worker, kind="slow", delay_ms=60)
    rc, doc, _, _ = canary(sim_worker.url, state)
    assert rc == 1
    assert doc["workers"][0]["kind"] == "latency_spike"
    assert "x the baseline" in doc["workers"][0]["reason"]


def test_hung_worker_times_out_with_exit_three(sim_worker: SimWorker, tmp_path: Path) -> None:
    """A hung worker (requests stall, no answer) is unreachable: exit 3 within about one timeout."""
    fault(sim_worker, kind="hang", duration_s=20)
    wait_until(lambda: hung(sim_worker), 10, "the hang fault in effect")
    rc, doc, _, elapsed = canary(sim_worker.url, tmp_path / "s.json", "--timeout", "1")
    assert rc == 3
    assert doc["workers"][0]["verdict"] == "unreachable"
    assert "within 1 s" in doc["workers"][0]["reason"]
    assert elapsed < 15


def test_killed_worker_exits_three(sim_worker: SimWorker, tmp_path: Path) -> None:
    """A SIGKILLed worker refuses connections: exit 3, no traceback."""
    sim_worker.kill()
    assert sim_worker.wait_exit(10) is not None
    rc, doc, _, _ = canary(sim_worker.url, tmp_path / "s.json")
    assert rc == 3
    assert "refused" in doc["workers"][0]["reason"]


# ---------------------------------------------------------------------------
# Garbage answers from a loopback server of our own


class _Garbage(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "html"

    def log_message(self, *args: object) -> None:
        del args

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode == "html":
            self._send(502, "text/html", b"<html><head><title>502 Bad Gateway</title></head>"
                                         b"<body>nginx</body></html>")
        elif mode == "truncated":
            self._send(200, "application/json", b'{"id": "x", "choices": [{"index": 0, "te')
        elif mode == "huge":
            self._send(200, "application/json", b'{"pad": "' + b"x" * (10 * 1024 * 1024) + b'"}')
        elif mode == "endless":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            deadline = time.monotonic() + 30
            try:
                while time.monotonic() < deadline:
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
                    self.wfile.flush()
                    time.sleep(0.01)
            except OSError:
                return

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            return


@pytest.fixture
def garbage_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize(("mode", "words"), [
    ("html", "HTTP 502 (text/html) page: '502 Bad Gateway'"),
    ("truncated", "truncated JSON"),
    ("endless", "did not end within 2 s"),
    ("huge", "response body over 1,048,576 bytes"),
])
def test_garbage_is_unhealthy_with_a_clear_reason(
    garbage_server: ThreadingHTTPServer, tmp_path: Path, mode: str, words: str,
) -> None:
    """HTML pages, truncated JSON, endless SSE and 10 MB bodies: exit 1, one reason, bounded."""
    garbage_server.mode = mode  # type: ignore[attr-defined]
    port = garbage_server.server_address[1]
    rc, doc, stderr, elapsed = canary(f"http://127.0.0.1:{port}", tmp_path / "s.json",
                                      "--timeout", "2")
    assert rc == 1, (doc, stderr)
    assert words in doc["workers"][0]["reason"]
    assert elapsed < 20
