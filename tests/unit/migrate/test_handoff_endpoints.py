"""The KV handoff's endpoints (migrate/handoff.py) for workers its inventory does not name."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.inventory import parse_inventory
from dynamo_ftctl.migrate.handoff import KvHandoff
from dynamo_ftctl.proxy.balancer import WorkerSlot
from dynamo_ftctl.proxy.ledger import StreamLedger

INVENTORY = """
cluster: t
workers:
  - {name: w0, url: "http://127.0.0.1:9001", model: m,
     admin: {url: "http://127.0.0.1:9101", token_env: W0_TOKEN}}
"""


def test_an_import_onto_a_worker_found_later_uses_its_own_url(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A worker found in DNS (or added by a reload) after the handoff was made: the import
    goes to its URL with the default admin token variable, instead of raising (which
    failed a request that could go on); an inventory worker keeps its admin endpoint."""
    monkeypatch.setenv("FTCTL_ADMIN_TOKEN", "dflt")
    monkeypatch.setenv("W0_TOKEN", "w0t")
    inventory = parse_inventory(INVENTORY)
    handoff = KvHandoff(inventory, inventory.proxy, FakeClock())
    ledger = StreamLedger("completions", {"prompt": "x", "max_tokens": 4})
    found = WorkerSlot(name="vllm-10-0-0-7-8000", url="http://10.0.0.7:8000", group="g",
                       model="m")
    url, data, headers = handoff.import_request(found, b"kv", ledger)
    assert url == "http://10.0.0.7:8000/admin/kv/import"
    assert data == b"kv"
    assert headers["Authorization"] == "Bearer dflt"
    known = WorkerSlot(name="w0", url="http://127.0.0.1:9001", group="w0", model="m")
    url, _, headers = handoff.import_request(known, b"kv", ledger)
    assert url == "http://127.0.0.1:9101/admin/kv/import"
    assert headers["Authorization"] == "Bearer w0t"
