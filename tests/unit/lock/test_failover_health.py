"""The failover health port on the package's HTTP server: status codes by state, routes,
and a busy port refused before anything starts."""

from __future__ import annotations

import socket

import pytest

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.lock.failover import EngineState, HealthServer, StateChange
from tests import fetch


def test_state_routes_answer_by_engine_state() -> None:
    """503 in INIT, 200 in STANDBY; /active only in ACTIVE; /metrics is Prometheus text."""
    current = {"state": EngineState.INIT}

    def snapshot() -> StateChange:
        return StateChange(current["state"], engine_id=3, at=0.0, lock="file")

    server = HealthServer("127.0.0.1", 0, snapshot)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert server.port != 0
        assert fetch.get(f"{base}/health", timeout=5).status == 503
        current["state"] = EngineState.STANDBY
        answer = fetch.get(f"{base}/health", timeout=5)
        assert (answer.status, answer.json()["state"]) == (200, "STANDBY")
        assert fetch.get(f"{base}/healthz", timeout=5).status == 200
        assert fetch.get(f"{base}/", timeout=5).status == 200
        assert fetch.get(f"{base}/active", timeout=5).status == 503
        current["state"] = EngineState.ACTIVE
        assert fetch.get(f"{base}/active", timeout=5).status == 200
        metrics = fetch.get(f"{base}/metrics", timeout=5)
        assert metrics.content_type.startswith("text/plain")
        assert fetch.post(f"{base}/health", timeout=5).status == 405
    finally:
        server.stop()


def test_a_busy_health_port_is_refused_when_built() -> None:
    """A port another socket listens on is `InvalidInput` from the constructor (before the
    engine is started), naming the flag."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidInput, match=f"--health-port {port}: cannot listen"):
            HealthServer("127.0.0.1", port, lambda: StateChange(EngineState.INIT, 1, 0.0, "f"))
