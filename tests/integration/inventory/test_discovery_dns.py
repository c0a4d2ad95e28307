"""DNS discovery against a real DNS server on loopback (tests/dnsserver.py): answers that
change, answers that fail, and hostile answers, each bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.discovery import Discovery, DiscoveryFailed, resolve_addresses
from dynamo_ftctl.inventory.discovery import DnsWorkers
from tests.dnsserver import DnsServer

pytestmark = pytest.mark.integration

NAME = "vllm.ns.svc.test"


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    """A DNS server on a free loopback port, stopped at teardown."""
    with DnsServer() as server:
        yield server


def source(server: DnsServer, **overrides: Any) -> DnsWorkers:
    """A `discovery:` entry for `server`. Its timeout only ends a wait for an answer that
    never comes; one that answers may take seconds on a machine at load 10 (CI: an SRV
    lookup missed a 1 s timeout), so the default is long and the failure tests set theirs."""
    settings: dict[str, Any] = {"name": "vllm", "dns": NAME, "model": "m", "port": 8000,
                                "resolver": server.address, "timeout_s": 10.0}
    return DnsWorkers(**{**settings, **overrides})


def resolve(src: DnsWorkers) -> tuple[list[str], int]:
    answer = asyncio.run(resolve_addresses(src))
    return [f"{a.host}:{a.port}" for a in answer.addresses], answer.found


def names(discovery: Discovery) -> list[str]:
    return [w.name for w in discovery.workers]


def test_a_and_aaaa_records_become_sorted_addresses(dns_server: DnsServer) -> None:
    """A and AAAA answers give every address once, IPv4 first, each sorted numerically."""
    dns_server.set_a(NAME, ["10.0.0.10", "10.0.0.9", "fd00::1", "10.0.0.9"])
    assert resolve(source(dns_server)) == (
        ["10.0.0.9:8000", "10.0.0.10:8000", "fd00::1:8000"], 3)


def test_srv_records_give_targets_and_ports_with_or_without_glue(dns_server: DnsServer) -> None:
    """SRV's targets are resolved from the additional section, or asked for when absent."""
    dns_server.set_srv(f"_http._tcp.{NAME}", [("p0.test", 9001), ("p1.test", 9002)])
    dns_server.set_a("p0.test", ["127.0.0.5"])
    dns_server.set_a("p1.test", ["127.0.0.6"])
    src = source(dns_server, srv=True)
    assert resolve(src) == (["127.0.0.5:9001", "127.0.0.6:9002"], 2)
    dns_server.glue = False
    assert resolve(src) == (["127.0.0.5:9001", "127.0.0.6:9002"], 2)


@pytest.mark.parametrize("behaviour", ["servfail", "drop", "garbage"])
def test_a_failed_resolution_raises_within_its_timeout(dns_server: DnsServer,
                                                       behaviour: str) -> None:
    """SERVFAIL, silence and a garbled answer are `DiscoveryFailed`, not a hang: silence
    ends at the timeout (the bound here leaves room for a busy machine)."""
    dns_server.behaviour[NAME] = behaviour
    started = time.monotonic()
    with pytest.raises(DiscoveryFailed):
        resolve(source(dns_server, timeout_s=0.5))
    assert time.monotonic() - started < 10


def test_a_cname_loop_is_a_failure_not_a_hang(dns_server: DnsServer) -> None:
    """A CNAME chain that comes back on itself fails the round (or finds nothing), in time."""
    dns_server.set_cname(NAME, "b.loop.test")
    dns_server.set_cname("b.loop.test", NAME)
    started = time.monotonic()
    try:
        addresses, _ = resolve(source(dns_server, timeout_s=0.5))
    except DiscoveryFailed:
        addresses = []
    assert addresses == []
    assert time.monotonic() - started < 10


def test_thousands_of_records_are_capped_at_max_workers(dns_server: DnsServer) -> None:
    """An answer of 10,000 A records (as many as a 64 KiB TCP message holds) gives the
    lowest max_workers addresses, and says how many there were."""
    dns_server.set_a(NAME, [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
                            for i in range(10_000)])
    addresses, found = resolve(source(dns_server, max_workers=16, timeout_s=5.0))
    assert len(addresses) == 16
    assert addresses[0] == "10.0.0.0:8000"
    assert 1000 < found <= 10_000


def run_round(discovery: Discovery, clock: FakeClock) -> bool:
    clock.advance(10)
    return asyncio.run(discovery.refresh())


def test_failures_and_one_empty_answer_keep_the_set_changes_apply(dns_server: DnsServer) -> None:
    """The set follows the answer; SERVFAIL, silence, garbage and NXDOMAIN for fewer than
    empty_after_rounds rounds keep it; a huge TTL does not freeze it (nothing is cached)."""
    from dynamo_ftctl import metrics

    clock = FakeClock()
    dns_server.ttl = 2**31 - 1
    dns_server.set_a(NAME, ["10.0.0.1", "10.0.0.2"])
    # 2 s: the silent round waits that out (twice, at most); the others answer.
    discovery = Discovery([source(dns_server, empty_after_rounds=2, timeout_s=2.0)],
                          clock=clock)
    assert run_round(discovery, clock)
    assert names(discovery) == ["vllm-10.0.0.1-8000", "vllm-10.0.0.2-8000"]
    assert [w.url for w in discovery.workers] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    before = metrics.DISCOVERY_FAILURES.labels("vllm", "servfail")._value.get()
    for behaviour in ("servfail", "drop", "garbage"):
        dns_server.behaviour[NAME] = behaviour
        assert not run_round(discovery, clock)
        assert len(discovery.workers) == 2
    assert metrics.DISCOVERY_FAILURES.labels("vllm", "servfail")._value.get() >= before + 1
    dns_server.behaviour.clear()
    dns_server.remove(NAME)
    assert not run_round(discovery, clock)  # NXDOMAIN once: kept
    assert len(discovery.workers) == 2
    dns_server.set_a(NAME, ["10.0.0.2", "10.0.0.3"])  # back, changed: taken at once
    assert run_round(discovery, clock)
    assert names(discovery) == ["vllm-10.0.0.2-8000", "vllm-10.0.0.3-8000"]
    dns_server.set_a(NAME, [])  # NODATA twice in a row: the workers leave
    assert not run_round(discovery, clock)
    assert run_round(discovery, clock)
    assert discovery.workers == ()


def test_only_due_entries_are_resolved(dns_server: DnsServer) -> None:
    """An entry is asked again only after its resolve_every_s."""
    clock = FakeClock()
    dns_server.set_a(NAME, ["10.0.0.1"])
    discovery = Discovery([source(dns_server, resolve_every_s=5)], clock=clock)
    asyncio.run(discovery.refresh())
    asked = dns_server.queries
    clock.advance(4)
    asyncio.run(discovery.refresh())
    assert dns_server.queries == asked
    assert discovery.wait_s() == pytest.approx(1)
    clock.advance(1)
    asyncio.run(discovery.refresh())
    assert dns_server.queries > asked
