"""Reporting GPU events to the canary daemon's POST /report."""

from __future__ import annotations

import json

import httpx
import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap, xid_event
from dynamo_ftctl.gpu.report import CanaryReporter, report_url


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

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/report"
        assert request.headers["authorization"] == "Bearer d4emon"
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"accepted": True})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    reporter = CanaryReporter("http://daemon:9400", token="d4emon", client=client)
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
    def refuse(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["worker"] == "w1":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(404, text="no such worker")

    reporter = CanaryReporter("http://daemon:9400",
                              client=httpx.Client(transport=httpx.MockTransport(refuse)))
    assert reporter.report(_event(79)) == 0
    assert reporter.failures == 2
    err = capsys.readouterr().err
    assert "cannot report w1" in err
    assert "HTTP 404" in err
