"""The inventory's `discovery:` entries and the workers they make (no DNS: tests/integration/
inventory/test_discovery_dns.py resolves against a real server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.discovery import (
    Address,
    Answer,
    Discovery,
    DiscoveryFailed,
    with_discovered,
    worker_name,
    workers_of,
)
from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.inventory import parse_inventory
from dynamo_ftctl.inventory.discovery import DnsWorkers

BASE = "cluster: c\n"
ENTRY = "discovery:\n  - {name: vllm, dns: vllm.ns.svc.cluster.local, model: m}\n"


def address(host: str, port: int = 8000) -> Address:
    from dynamo_ftctl.discovery import _address

    found = _address(host, port)
    assert found is not None
    return found


def test_an_inventory_may_have_only_discovered_workers() -> None:
    """`discovery:` without `workers:` loads; neither is an error naming `workers`."""
    inventory = parse_inventory(BASE + ENTRY)
    assert inventory.workers == ()
    assert inventory.discovery[0].port == 8000
    assert inventory.discovery[0].resolve_every_s == 5.0
    with pytest.raises(InventoryError, match="workers: give at least one worker"):
        parse_inventory(BASE)


@pytest.mark.parametrize(("entry", "message"), [
    ("{name: v, dns: 'bad name', model: m}", "dns: not a DNS name"),
    ("{name: v, dns: a..b, model: m}", "dns: not a DNS name"),
    ("{name: v, dns: " + "a" * 64 + ".b, model: m}", "dns: not a DNS name"),
    ("{name: v, dns: a.b, model: m, resolver: dns.local:53}", "must be an IP address"),
    ("{name: v, dns: a.b, model: m, resolver: 127.0.0.1}", "expected HOST:PORT"),
    ("{name: v, dns: a.b, model: m, port: 0}", "port"),
    ("{name: v, dns: a.b, model: m, max_workers: 5000}", "max_workers"),
    ("{name: v, dns: a.b, model: m, resolve_every_s: 0}", "resolve_every_s"),
    ("{name: " + "v" * 25 + ", dns: a.b, model: m}", "at most 24 characters"),
    ("{name: 'v/x', dns: a.b, model: m}", "invalid name"),
    ("{name: v, dns: a.b, model: m, url: http://x}", "unknown key"),
])
def test_bad_entries_are_one_line_naming_the_key(entry: str, message: str) -> None:
    """Each bad discovery entry is refused with file, line and key."""
    with pytest.raises(InventoryError, match=message) as err:
        parse_inventory(f"{BASE}discovery:\n  - {entry}\n", Path("f.yaml"))
    assert str(err.value).startswith("f.yaml:3: discovery[0]")


def test_duplicate_entries_and_procs_are_refused() -> None:
    """Two entries of one name, or discovery with proxy.procs > 1, are refused."""
    with pytest.raises(InventoryError, match="duplicate discovery name"):
        parse_inventory(BASE + ENTRY + "  - {name: vllm, dns: other.test, model: m}\n")
    with pytest.raises(InventoryError, match=r"proxy\.procs"):
        parse_inventory(BASE + ENTRY + "proxy: {procs: 2}\n")


def test_worker_names_are_deterministic_and_valid() -> None:
    """`<entry>-<address>-<port>`; an IPv6 address's colons become dashes; a name past 63
    characters becomes the entry and a digest, the same for the same address."""
    src = DnsWorkers(name="vllm", dns="a.test", model="m")
    assert worker_name(src, address("10.0.0.3")) == "vllm-10.0.0.3-8000"
    assert worker_name(src, address("fd00::1", 80)) == "vllm-fd00--1-80"
    long = address("fd00:1234:5678:9abc:def0:1234:5678:9abc", 65535)
    assert worker_name(src, long) == worker_name(src, long)
    assert worker_name(src, long).startswith("vllm-")
    assert len(worker_name(DnsWorkers(name="v" * 24, dns="a.test", model="m"), long)) <= 63
    https = DnsWorkers(name="s", dns="a.test", model="m", scheme="https")
    assert [w.url for w in workers_of(https, [address("fd00::1", 443)])] == \
        ["https://[fd00::1]:443"]


def test_discovered_workers_never_shadow_inventory_workers() -> None:
    """A discovered worker named like an inventory worker is left out."""
    inventory = parse_inventory(BASE + "workers:\n  - {name: vllm-10.0.0.1-8000, "
                                "url: http://x:1, model: m}\n" + ENTRY)
    src = inventory.discovery[0]
    merged = with_discovered(inventory, workers_of(src, [address("10.0.0.1"),
                                                         address("10.0.0.2")]))
    assert [w.url for w in merged.workers] == ["http://x:1", "http://10.0.0.2:8000"]


def test_a_bug_in_a_round_keeps_the_set_and_retarget_keeps_unchanged_entries() -> None:
    """An exception other than DiscoveryFailed keeps the set too; a reload that changes only
    resolve_every_s keeps an entry's workers, one that changes its dns drops them."""
    clock = FakeClock()
    answers: list[Answer | Exception] = [
        Answer((address("10.0.0.1"),), 1), RuntimeError("bug"),
        DiscoveryFailed("timeout", "slow")]

    async def resolve(_: DnsWorkers) -> Answer:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    src = DnsWorkers(name="v", dns="a.test", model="m")
    discovery = Discovery([src], clock=clock, resolve=resolve)
    for _ in range(3):
        asyncio.run(discovery.refresh())
        clock.advance(10)
        assert [w.name for w in discovery.workers] == ["v-10.0.0.1-8000"]
    discovery.retarget([DnsWorkers(name="v", dns="a.test", model="m", resolve_every_s=1)])
    assert len(discovery.workers) == 1
    discovery.retarget([DnsWorkers(name="v", dns="b.test", model="m")])
    assert discovery.workers == ()
