"""Workers found in DNS: the inventory's `discovery:` entries, resolved every few seconds.

As nginx (`resolve`) and Envoy (STRICT_DNS) follow a Kubernetes headless Service: each
entry's name is resolved every `resolve_every_s` (A and AAAA, or SRV with the targets'
addresses from the answer's additional section or their own queries), and every address
becomes an inventory `Worker` named `<entry>-<address>-<port>` (`worker_name`). The
callers (the proxy's `Fleet`, the canary daemon) hand the new set to the path an
inventory reload takes, so a worker that leaves drains: no new request, streams under
way run to their end.

What an answer may do is bounded here, not by the callers:

- **A failure keeps the last set.** A timeout, SERVFAIL, a refused or garbled answer, a
  CNAME chain that does not end: one log line and `ftctl_discovery_failures_total`,
  and the workers stay as they were, however many rounds it lasts.
- **Nothing found must be seen `empty_after_rounds` times in a row** (NXDOMAIN or no
  records) before the entry's workers leave: one bad answer never empties the fleet.
- **At most `max_workers` addresses** an answer: the lowest (sorted, so the choice is
  the same every round whatever order the server shuffles them in), the rest logged.
- **TTLs are ignored**: nothing is cached, every round asks again (a huge TTL cannot
  freeze the set); a DNS message is at most 64 KiB, so one answer holds at most a few
  thousand records, parsed by dnspython.

dnspython is imported when the first name is resolved, never at start-up (`ftctl
--help` and the probes stay light). Errors from it (`dns.exception.DNSException`) and
from sockets end here, as `DiscoveryFailed`; the loop never raises them.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.inventory import Inventory, Worker
from dynamo_ftctl.inventory.discovery import DnsWorkers
from dynamo_ftctl.structs import check_name, replace

if TYPE_CHECKING:
    from collections.abc import Awaitable

__all__ = [
    "Address",
    "Discovery",
    "DiscoveryFailed",
    "resolve_addresses",
    "with_discovered",
    "worker_name",
    "workers_of",
]

log = logging.getLogger("ftctl.discovery")


class DiscoveryFailed(Exception):
    """A name could not be resolved this round (timeout, SERVFAIL, garbage, a loop)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # the metric's label: timeout, servfail, error


@dataclass(frozen=True, order=True)
class Address:
    """One endpoint found: an IP address (v4 sorts before v6) and its port."""

    key: tuple[int, int] = field(repr=False)  # (version, integer value): the sort order
    host: str = field(compare=False)
    port: int


def _address(host: str, port: int) -> Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return Address((ip.version, int(ip)), ip.compressed, port)


@dataclass(frozen=True)
class Answer:
    """What one resolution found: addresses (sorted, capped) and how many there were."""

    addresses: tuple[Address, ...]
    found: int  # before the cap


def worker_name(source: DnsWorkers, address: Address) -> str:
    """`<entry>-<address>-<port>` (an IPv6 address's ':' as '-'); past 63 characters, the
    entry and a digest of the address: the same address always gets the same name."""
    name = f"{source.name}-{address.host.replace(':', '-')}-{address.port}"
    try:
        return check_name(name)
    except ValueError:
        digest = hashlib.blake2s(f"{address.host}:{address.port}".encode(),
                                 digest_size=6).hexdigest()
        return check_name(f"{source.name}-{digest}")


def workers_of(source: DnsWorkers, addresses: Iterable[Address]) -> tuple[Worker, ...]:
    """The inventory workers of `addresses` found for `source`."""
    workers = []
    for address in addresses:
        host = f"[{address.host}]" if ":" in address.host else address.host
        workers.append(Worker(name=worker_name(source, address), model=source.model,
                              url=f"{source.scheme}://{host}:{address.port}",
                              node=address.host))
    return tuple(workers)


def with_discovered(inventory: Inventory, discovered: Sequence[Worker]) -> Inventory:
    """`inventory` with `discovered` after its own workers; a discovered worker named like
    one of them is left out (logged)."""
    names = {w.name for w in inventory.workers}
    extra = []
    for worker in discovered:
        if worker.name in names:
            log.warning("discovered worker %s has the name of an inventory worker: left out",
                        worker.name)
            continue
        names.add(worker.name)
        extra.append(worker)
    return replace(inventory, workers=(*inventory.workers, *extra))


# ---------------------------------------------------------------------- resolving


def _resolver(source: DnsWorkers) -> Any:
    import dns.asyncresolver

    resolver = dns.asyncresolver.Resolver(configure=source.resolver is None)
    if source.resolver is not None:
        host, _, port = source.resolver.rpartition(":")
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    resolver.cache = None  # every round asks: a TTL of a year cannot freeze the set
    resolver.timeout = resolver.lifetime = source.timeout_s
    return resolver


async def _query(resolver: Any, name: str, rdtype: str) -> Any | None:
    """The answer's response message for (`name`, `rdtype`); None for NXDOMAIN or no
    records. `DiscoveryFailed` for anything else."""
    import dns.exception
    import dns.resolver

    try:
        answer = await resolver.resolve(name + ".", rdtype, search=False,
                                        raise_on_no_answer=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return None
    except dns.exception.Timeout as exc:
        raise DiscoveryFailed("timeout", f"{name} {rdtype}: {exc}") from None
    except dns.resolver.NoNameservers as exc:  # SERVFAIL, REFUSED, garbage from each server
        raise DiscoveryFailed("servfail", f"{name} {rdtype}: {exc}") from None
    except (dns.exception.DNSException, OSError, ValueError) as exc:
        raise DiscoveryFailed("error", f"{name} {rdtype}: {type(exc).__name__}: {exc}") \
            from None
    return answer if answer.rrset is not None else None


def _addresses_in(answer: Any, port: int) -> list[Address]:
    found = []
    for rdata in answer.rrset or ():
        address = _address(getattr(rdata, "address", ""), port)
        if address is not None:
            found.append(address)
    return found


async def _hosts(resolver: Any, name: str, port: int) -> list[Address]:
    a, aaaa = await asyncio.gather(_query(resolver, name, "A"), _query(resolver, name, "AAAA"))
    return [*(_addresses_in(a, port) if a else ()), *(_addresses_in(aaaa, port) if aaaa else ())]


async def _srv_hosts(resolver: Any, source: DnsWorkers) -> list[Address]:
    import dns.rdatatype

    name = source.dns if source.dns.startswith("_") else f"_http._tcp.{source.dns}"
    answer = await _query(resolver, name, "SRV")
    if answer is None:
        return []
    targets = sorted({(str(r.target).rstrip(".").lower(), int(r.port)) for r in answer.rrset
                      if str(r.target) != "."})
    if len(targets) > source.max_workers:
        log.warning("%s: %d SRV targets, only the first %d (max_workers) are resolved",
                    name, len(targets), source.max_workers)
        targets = targets[:source.max_workers]
    # Glue: the addresses of the targets in the additional section (CoreDNS sends them).
    glue: dict[str, list[str]] = {}
    for rrset in answer.response.additional:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            glue.setdefault(str(rrset.name).rstrip(".").lower(), []).extend(
                r.address for r in rrset)
    found: list[Address] = []
    missing = []
    for target, port in targets:
        if target in glue:
            found.extend(a for h in glue[target] if (a := _address(h, port)) is not None)
        else:
            missing.append((target, port))
    for hosts in await asyncio.gather(*(_hosts(resolver, t, p) for t, p in missing)):
        found.extend(hosts)
    return found


async def resolve_addresses(source: DnsWorkers) -> Answer:
    """Resolve `source` once: its addresses, sorted, at most `max_workers`.

    Nothing found (NXDOMAIN, no records) is an empty answer; a timeout, SERVFAIL or
    unreadable answer raises `DiscoveryFailed`, and so does a resolution slower than
    `timeout_s` in all.
    """
    resolver = _resolver(source)
    try:
        async with asyncio.timeout(source.timeout_s * 2):
            found = await (_srv_hosts(resolver, source) if source.srv
                           else _hosts(resolver, source.dns, source.port))
    except TimeoutError:
        raise DiscoveryFailed("timeout", f"{source.dns}: no answer within "
                              f"{source.timeout_s * 2:g} s") from None
    unique = sorted(set(found))
    return Answer(tuple(unique[:source.max_workers]), len(unique))


# ---------------------------------------------------------------------- the loop

Resolve = Callable[[DnsWorkers], "Awaitable[Answer]"]


@dataclass
class _Followed:
    """One discovery entry: the addresses last accepted and the empty rounds since."""

    source: DnsWorkers
    addresses: tuple[Address, ...] = ()
    empty_rounds: int = 0
    due: float = 0.0
    workers: tuple[Worker, ...] = ()


def _same_workers(old: DnsWorkers, new: DnsWorkers) -> bool:
    """Whether `new` makes the same workers of the same addresses as `old`."""
    return (old.dns, old.srv, old.port, old.scheme, old.model, old.resolver) == \
        (new.dns, new.srv, new.port, new.scheme, new.model, new.resolver)


class Discovery:
    """The workers of every discovery entry, as last resolved (see the module docstring).

    `refresh` resolves the entries that are due and says whether any set changed;
    `workers` is the current set; `run` does both for ever and hands every change to a
    callback. Takes a `Clock`; `resolve` is the seam for tests that need no DNS server.
    """

    def __init__(self, sources: Iterable[DnsWorkers], *, clock: Clock = SYSTEM_CLOCK,
                 resolve: Resolve = resolve_addresses) -> None:
        self._clock = clock
        self._resolve = resolve
        self._followed: dict[str, _Followed] = {}
        self.retarget(sources)

    def retarget(self, sources: Iterable[DnsWorkers]) -> None:
        """Follow `sources` from now on (an inventory reload): an entry that did not change
        keeps its workers; a changed or new one is resolved at the next `refresh`."""
        followed = {}
        for source in sources:
            old = self._followed.get(source.name)
            if old is not None and _same_workers(old.source, source):
                old.source = source
                old.due = min(old.due, self._clock.now() + source.resolve_every_s)
                followed[source.name] = old
            else:
                followed[source.name] = _Followed(source)
        self._followed = followed

    @property
    def workers(self) -> tuple[Worker, ...]:
        """Every discovered worker, entry by entry, each entry's sorted by address."""
        return tuple(w for f in self._followed.values() for w in f.workers)

    def wait_s(self) -> float:
        """Seconds until the next entry is due."""
        if not self._followed:
            return 3600.0
        return max(0.0, min(f.due for f in self._followed.values()) - self._clock.now())

    async def refresh(self) -> bool:
        """Resolve every entry that is due; True when a set of workers changed."""
        now = self._clock.now()
        due = [f for f in self._followed.values() if f.due <= now]
        for followed in due:
            followed.due = now + followed.source.resolve_every_s
        results = await asyncio.gather(*(self._resolve(f.source) for f in due),
                                       return_exceptions=True)
        changed = False
        for followed, result in zip(due, results, strict=True):
            changed |= self._take(followed, result)
        return changed

    def _take(self, followed: _Followed, result: Answer | BaseException) -> bool:
        from dynamo_ftctl import metrics

        source = followed.source
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # CancelledError, KeyboardInterrupt: not a DNS answer
            reason = result.reason if isinstance(result, DiscoveryFailed) else "error"
            metrics.DISCOVERY_FAILURES.labels(source.name, reason).inc()
            log.warning("discovery %s: %s resolution failed, keeping its %d workers: %s",
                        source.name, source.dns, len(followed.workers), result)
            return False
        if result.found > len(result.addresses):
            metrics.DISCOVERY_FAILURES.labels(source.name, "capped").inc()
            log.warning("discovery %s: %s has %d addresses; only the first %d (max_workers) "
                        "become workers", source.name, source.dns, result.found,
                        len(result.addresses))
        if not result.addresses and followed.addresses:
            followed.empty_rounds += 1
            if followed.empty_rounds < source.empty_after_rounds:
                metrics.DISCOVERY_FAILURES.labels(source.name, "empty").inc()
                log.warning("discovery %s: %s resolves to nothing (%d of %d rounds in a row); "
                            "keeping its %d workers", source.name, source.dns,
                            followed.empty_rounds, source.empty_after_rounds,
                            len(followed.workers))
                return False
        followed.empty_rounds = 0
        if result.addresses == followed.addresses:
            return False
        before = {w.name for w in followed.workers}
        followed.addresses = result.addresses
        followed.workers = workers_of(source, result.addresses)
        after = {w.name for w in followed.workers}
        metrics.DISCOVERED_WORKERS.labels(source.name).set(len(followed.workers))
        log.warning("discovery %s: %s now gives %d workers; added: %s; removed: %s",
                    source.name, source.dns, len(after), ", ".join(sorted(after - before))
                    or "none", ", ".join(sorted(before - after)) or "none")
        return True

    async def run(self, on_change: Callable[[tuple[Worker, ...]], None]) -> None:
        """Refresh for ever; `on_change(workers)` after each round that changed a set."""
        while True:
            try:
                changed = await self.refresh()
            except Exception:  # a bug must not stop the loop (the workers stay)
                log.exception("discovery round failed; the workers stay as they are")
                changed = False
            if changed:
                on_change(self.workers)
            # At most 1 s: an entry a reload adds (`retarget`) is resolved within it.
            await self._clock.asleep(min(1.0, max(0.05, self.wait_s())))
