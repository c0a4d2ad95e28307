"""Reporting GPU events to the canary daemon's POST /report."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap, xid_event
from dynamo_ftctl.gpu.report import CanaryReporter, report_url
from dynamo_ftctl.health.transport import TransportError
from dynamo_ftctl.http1 import MockTransport, Reply, Request


def _Transport(handler: Callable[[str, dict[str, object], Mapping[str, str]],
                                 Reply]) -> MockTransport:
    """A `MockTransport` whose requests are answered by `handler(url, body, headers)`."""

    def handle(request: Request) -> Reply:
        assert request.timeout_s > 0
        return handler(request.url, request.json(), request.headers)

    return MockTransport(handle)


class _W:
    def __init__(self, name: str, node: str, gpus: tuple[int, ...]) -> None:
        self.name, self.node, self.gpus = name, node, gpus


class _Inv:
    workers = (_W("w1", "node-a", (0,)), _W("w2", "node-a", (0,)))


def _event(xid: int) -> GpuEvent:
    return xid_event(xid=xid, ts=FakeClock().wall(), source="nvml", node="node-a", gpu=0,
                     pci_bus_id="0000:3b:00", message="", workers=WorkerMap(_Inv()))


def test_report_url() -> None:
    """A base URL gets /report; an explicit /report URL stays."""
    assert report_url("http://127.0.0.1:9400") == "http://127.0.0.1:9400/report"
    assert report_url("http://h:1/report/") == "http://h:1/report"


def test_actionable_event_is_posted_per_worker() -> None:
    """An Xid 48 posts one ok=false body per affected worker, with the daemon's token."""
    seen: list[dict[str, object]] = []

    def handler(url: str, body: dict[str, object], headers: Mapping[str, str]) -> Reply:
        assert url == "http://daemon:9400/report"
        assert {k.lower(): v for k, v in headers.items()}["authorization"] == "Bearer d4emon"
        seen.append(body)
        return Reply(200, b'{"accepted": true}', {"content-type": "application/json"})

    reporter = CanaryReporter("http://daemon:9400", token="d4emon",
                              transport=_Transport(handler))
    assert reporter.report(_event(48)) == 2
    assert seen == [
        {"worker": w, "ok": False, "source": "gpu",
         "reason": "xid 48: Double Bit ECC Error (uncorrectable memory error) (RESET_GPU)"}
        for w in ("w1", "w2")
    ]
    assert reporter.report(_event(63)) == 0  # IGNORE: not sent
    assert len(seen) == 2


def test_daemon_down_or_refusing_is_counted_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    """Connection errors and HTTP errors are warnings and counts; the watcher goes on."""
    def refuse(_url: str, body: dict[str, object], _headers: Mapping[str, str]) -> Reply:
        if body["worker"] == "w1":
            raise TransportError("refused", "connection refused by daemon:9400")
        return Reply(404, b"no such worker", {"content-type": "text/plain"})

    reporter = CanaryReporter("http://daemon:9400", transport=_Transport(refuse))
    assert reporter.report(_event(79)) == 0
    assert reporter.failures == 2
    err = capsys.readouterr().err
    assert "cannot report w1" in err
    assert "HTTP 404" in err


def test_the_default_transport_counts_a_closed_port(capsys: pytest.CaptureFixture[str]) -> None:
    """With the real blocking client, a daemon that is not listening is one failure each."""
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reporter = CanaryReporter(f"http://127.0.0.1:{port}", timeout_s=2.0)
    assert reporter.report(_event(48)) == 0
    assert reporter.failures == 2
    assert "cannot report w1" in capsys.readouterr().err
