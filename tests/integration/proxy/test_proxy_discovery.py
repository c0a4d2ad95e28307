"""The proxy following a DNS name (tests/dnsserver.py, a real server on loopback) in front of
real `ftctl sim` workers: workers join and leave under load without a failed request."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import fetch
from tests.dnsserver import DnsServer
from tests.integration.proxy.test_proxy_sim import (
    MODEL,
    ProxyProcess,
    Streamed,
    set_fault,
    spawn_proxy,
    stream,
    wait_until,
)

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory

pytestmark = pytest.mark.integration

NAME = "sims.ns.svc.test"
# Streams of 30 tokens at 20 ms a token (the sims' `slow` fault): ~0.6 s each, so every
# change of the answer meets streams under way on the workers it adds or removes.
BODY = {"model": MODEL, "prompt": "discovery", "max_tokens": 30, "temperature": 0,
        "ignore_eos": True}


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    """A DNS server on a free loopback port, stopped at teardown."""
    with DnsServer() as server:
        yield server


def start_proxy(tmp_path: Path, entry: dict[str, Any]) -> ProxyProcess:
    inventory = {
        "cluster": "discovery-test",
        "discovery": [entry],
        "proxy": {"listen": "127.0.0.1:0", "scrape_interval_s": 0.1, "stall_timeout_s": 5.0},
    }
    return spawn_proxy(inventory, tmp_path)


def workers(proxy: ProxyProcess) -> set[str]:
    return set(fetch.get(f"{proxy.url}/health", timeout=5).json()["workers"])


class Load:
    """`clients` threads streaming requests through the proxy until `stop` (bounded: each
    request has the client's 60 s timeout, and the test joins them)."""

    def __init__(self, proxy: ProxyProcess, clients: int) -> None:
        self.results: list[Streamed | BaseException] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        self._jobs = [self._pool.submit(self._client, proxy) for _ in range(clients)]

    def _client(self, proxy: ProxyProcess) -> None:
        while not self._stop.is_set():
            try:
                self.results.append(stream(proxy, "/v1/completions", BODY))
            except Exception as exc:  # a failed request is a result here
                self.results.append(exc)

    def served_by(self) -> set[str]:
        return {r.headers.get("x-ftctl-worker", "") for r in list(self.results)
                if isinstance(r, Streamed)}

    def stop(self) -> list[Streamed | BaseException]:
        self._stop.set()
        for job in self._jobs:
            job.result(timeout=90)
        self._pool.shutdown()
        return self.results


def test_workers_join_and_leave_under_load_without_a_failed_request(
    dns_server: DnsServer, sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """A records on one port: a worker added to the answer takes requests; one removed
    drains (its streams finish there, none migrates); NXDOMAIN for a round keeps the set;
    8 clients streaming throughout see no failed request and the same greedy text."""
    port = free_port("127.0.0.2")
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    sims = [sim_worker_factory(name=f"d{i}", host=h, port=port) for i, h in enumerate(hosts)]
    for sim in sims:
        set_fault(sim, {"kind": "slow", "delay_ms": 20})
    names = [f"sims-{h}-{port}" for h in hosts]
    dns_server.set_a(NAME, hosts[:1])
    proxy = start_proxy(tmp_path, {"name": "sims", "dns": NAME, "model": MODEL, "port": port,
                                   "resolver": dns_server.address, "resolve_every_s": 0.1,
                                   "timeout_s": 0.5, "empty_after_rounds": 3})
    load: Load | None = None
    try:
        assert workers(proxy) == {names[0]}  # the first answer is served from the start
        load = Load(proxy, 8)
        wait_until(lambda: len(load.results) >= 8, 30, "requests served by the first worker")
        dns_server.set_a(NAME, hosts)
        wait_until(lambda: workers(proxy) == set(names), 10, "two workers joining")
        wait_until(lambda: set(names) <= load.served_by(), 30, "requests on every worker")
        dns_server.set_a(NAME, hosts[1:])  # d0 leaves with streams under way
        wait_until(lambda: workers(proxy) == set(names[1:]), 10, "d0 leaving")
        served = len(load.results)
        dns_server.remove(NAME)  # NXDOMAIN, one round and a bit: the set stays
        wait_until(lambda: "resolves to nothing (1 of 3" in proxy.log_text(), 10,
                   "an NXDOMAIN round")
        dns_server.set_a(NAME, hosts[1:])
        assert workers(proxy) == set(names[1:])
        wait_until(lambda: len(load.results) >= served + 16, 30, "requests after the changes")
    finally:
        results = load.stop() if load is not None else []
        proxy.stop()
    failed = [r for r in results if not isinstance(r, Streamed) or r.status != 200
              or r.error is not None or not r.done]
    assert not failed, failed[:3]
    assert len({r.text for r in results if isinstance(r, Streamed)}) == 1
    assert all(isinstance(r, Streamed) and r.migrated == 0 for r in results)
    assert set(names) <= {r.headers["x-ftctl-worker"] for r in results
                          if isinstance(r, Streamed)}
    assert "removed: " + names[0] in proxy.log_text()


def test_srv_records_give_workers_on_their_own_ports(
    dns_server: DnsServer, sim_worker_factory: SimWorkerFactory, tmp_path: Path,
) -> None:
    """SRV answers name each worker's port: two sims on one address, then one leaves."""
    sims = [sim_worker_factory(name=f"s{i}") for i in range(2)]
    ports = [int(s.url.rsplit(":", 1)[1]) for s in sims]
    dns_server.set_a("s0.test", ["127.0.0.1"])
    dns_server.set_a("s1.test", ["127.0.0.1"])
    dns_server.set_srv(f"_http._tcp.{NAME}", [("s0.test", ports[0]), ("s1.test", ports[1])])
    proxy = start_proxy(tmp_path, {"name": "srv", "dns": NAME, "model": MODEL, "srv": True,
                                   "resolver": dns_server.address, "resolve_every_s": 0.1,
                                   "timeout_s": 0.5})
    try:
        names = {f"srv-127.0.0.1-{p}" for p in ports}
        assert workers(proxy) == names
        got = [stream(proxy, "/v1/completions", BODY) for _ in range(4)]
        assert {g.headers["x-ftctl-worker"] for g in got} == names
        dns_server.set_srv(f"_http._tcp.{NAME}", [("s1.test", ports[1])])
        wait_until(lambda: workers(proxy) == {f"srv-127.0.0.1-{ports[1]}"}, 10, "s0 leaving")
        assert all(g.error is None for g in got)
    finally:
        proxy.stop()
