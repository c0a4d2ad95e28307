"""`ftctl canary --watch` following a DNS name (tests/dnsserver.py) over `ftctl sim` workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.dnsserver import DnsServer
from tests.integration.health.test_daemon_sim import ROOT, probed, read_line, states
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

pytestmark = pytest.mark.integration


def test_the_daemon_probes_workers_as_they_join_and_forgets_those_that_leave(
    sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """SRV answers: the first worker is probed from the start, a second one joining is probed
    and HEALTHY, one leaving disappears from GET /workers; SERVFAIL keeps both."""
    sims = [sim_worker_factory(name=f"c{i}") for i in range(2)]
    ports = [int(s.url.rsplit(":", 1)[1]) for s in sims]
    names = [f"sims-127.0.0.1-{p}" for p in ports]
    srv = "_http._tcp.sims.test"
    with DnsServer() as dns_server:
        dns_server.set_a("c0.test", ["127.0.0.1"])
        dns_server.set_a("c1.test", ["127.0.0.1"])
        dns_server.set_srv(srv, [("c0.test", ports[0])])
        inventory = {
            "cluster": "t",
            "discovery": [{"name": "sims", "dns": "sims.test", "srv": True,
                           "model": "ftctl-sim-tiny", "resolver": dns_server.address,
                           "resolve_every_s": 0.1, "timeout_s": 0.5}],
            "canary": {"interval_s": 0.5, "timeout_s": 1.0, "max_retries": 0,
                       "set": str(ROOT / "canaries" / "ftctl-sim-tiny.yaml"),
                       "state_file": str(tmp_path / "state.json")},
        }
        inv = tmp_path / "inv.yaml"
        inv.write_text(json.dumps(inventory))
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", "-i", str(inv), "canary", "--watch",
             "--json", "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=dict(os.environ))
        try:
            line = ""
            for _ in range(20):  # discovery's log lines come first
                line = read_line(proc.stderr, proc, 60)
                if "http://127.0.0.1:" in line:
                    break
            url = line.strip().rsplit(" ", 1)[-1]
            assert url.startswith("http://127.0.0.1:"), line
            assert list(states(url)) == names[:1]
            dns_server.set_srv(srv, [("c0.test", ports[0]), ("c1.test", ports[1])])
            wait_until(lambda: set(states(url)) == set(names) and probed(url), 15, "c1 probed")
            assert set(states(url).values()) == {"healthy"}
            dns_server.behaviour["_http._tcp.sims.test"] = "servfail"
            dns_server.set_srv(srv, [("c1.test", ports[1])])
            wait_until(lambda: dns_server.queries > 20, 10, "failing rounds")
            assert set(states(url)) == set(names)
            dns_server.behaviour.clear()
            wait_until(lambda: set(states(url)) == set(names[1:]), 10, "c0 leaving")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
