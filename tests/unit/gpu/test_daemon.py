"""The GPU watchers as library calls (`gpu.daemon`): events fed, counted and served as
metrics on the package's HTTP server, advice handed to the caller."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.gpu.daemon import (
    FAKE_ENV,
    FeedOptions,
    MetricsServer,
    resolve_pci_map,
    watch_kernel_log,
    watch_nvml,
)
from dynamo_ftctl.gpu.events import GpuEvent, WorkerMap
from dynamo_ftctl.http1 import ConnectError
from dynamo_ftctl.inventory import parse_inventory
from tests import fetch

KERN_LOG = """\
[ 966.503025] NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=vllm, An uncorrectable double bit error
[ 967.000000] NVRM: Xid (PCI:0000:86:00): 63, pid=1234, Row Remapper: New row marked for remapping
[ 968.000000] NVRM: Xid (PCI:garbage): 48
"""


def _workers() -> WorkerMap:
    inventory = parse_inventory(json.dumps({"cluster": "t", "workers": [
        {"name": "w1", "url": "http://127.0.0.1:8101", "model": "m", "node": "node-a",
         "gpus": [0]}]}))
    return WorkerMap(inventory)


def test_kernel_log_events_reach_the_caller_with_a_summary(tmp_path: Path) -> None:
    """A log file is read to its end: each Xid goes to `on_event` (an unmapped GPU names
    every worker of the node), the summary counts lines."""
    log = tmp_path / "kern.log"
    log.write_text(KERN_LOG)
    seen: list[GpuEvent] = []
    warnings: list[str] = []
    summary = watch_kernel_log(FeedOptions(node="node-a", workers=_workers()),
                               source=str(log), follow=False, pci_map="0000:3b:00=0",
                               poll_s=0.01, on_event=seen.append, on_warning=warnings.append)
    assert [(e.xid, e.gpu, e.workers) for e in seen] == [(48, 0, ("w1",)), (63, None, ("w1",))]
    assert (summary.events, summary.lines, summary.xids) == (2, 3, 2)
    assert summary.actionable == sum(e.actionable for e in seen) >= 1
    assert summary.malformed == 1
    assert warnings == []


def test_an_unknown_node_and_a_report_without_token_are_warned(tmp_path: Path) -> None:
    """A node outside the inventory and a report URL with no token each give one warning;
    `count` stops the feed."""
    log = tmp_path / "kern.log"
    log.write_text(KERN_LOG)
    warnings: list[str] = []
    options = FeedOptions(node="elsewhere", workers=_workers(), count=1,
                          report_url="http://127.0.0.1:9/report", token=None)
    summary = watch_kernel_log(options, source=str(log), follow=False, pci_map="0000:3b:00=0",
                               poll_s=0.01, on_event=lambda _e: None,
                               on_warning=warnings.append)
    assert summary.events == 1
    assert any("'elsewhere' is not in the inventory" in w for w in warnings)
    assert any("FTCTL_DAEMON_TOKEN is not set" in w for w in warnings)


def test_nvml_watch_with_the_fake_and_its_metrics(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`watch_nvml` on the scripted fake feeds its Xid; the metrics port answers while it
    runs and is closed after."""
    spec = tmp_path / "fake.json"
    spec.write_text(json.dumps({"gpus": 1, "script": [{"xids": [[0, 79]]}]}))
    monkeypatch.setenv(FAKE_ENV, str(spec))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scraped: list[str] = []

    def on_event(_event: GpuEvent) -> None:
        scraped.append(fetch.get(f"http://127.0.0.1:{port}/metrics").text)

    summary = watch_nvml(FeedOptions(node="node-a", count=1, metrics_port=port),
                         interval_s=0.01, duration_s=10.0, on_event=on_event,
                         on_warning=lambda _w: None)
    assert summary.events == 1
    assert 'ftctl_xid_events_total{gpu="0",xid="79"}' in scraped[0]
    with pytest.raises(ConnectError):
        fetch.get(f"http://127.0.0.1:{port}/metrics")


def test_metrics_server_refuses_a_busy_port() -> None:
    """A port in use is one `InvalidInput` naming --metrics-port."""
    first = MetricsServer("127.0.0.1", 0).start()
    try:
        with pytest.raises(InvalidInput, match=f"--metrics-port {first.port}: cannot listen"):
            MetricsServer("127.0.0.1", first.port).start()
    finally:
        first.stop()


def test_an_explicit_pci_map_wins() -> None:
    """`--pci-map` is parsed and used as given (NVML and procfs are not asked)."""
    assert resolve_pci_map("0000:3b:00=0,0000:86:00=1") == {"0000:3b:00": 0, "0000:86:00": 1}
