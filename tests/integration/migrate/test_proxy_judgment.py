"""Issue 29's judgment against real `ftctl sim` processes and the real `ftctl proxy`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.integration.migrate.test_proxy_sim import MODEL, proxy_factory

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory
    from tests.integration.migrate.test_proxy_sim import ProxyFactory

__all__ = ["proxy_factory"]

pytestmark = pytest.mark.integration

POISON_SEED = 666  # the sims' poison fault: a request with this seed ends its whole batch


def healthy() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def poison() -> dict[str, Any]:
    return {**healthy(), "prompt": "poison", "max_tokens": 8, "seed": POISON_SEED,
            "temperature": 1}


def breakers_open(client: httpx.Client) -> list[str]:
    workers = client.get("/health").json().get("workers", {})
    return [n for n, w in workers.items() if isinstance(w, dict) and w.get("breaker") == "open"]


def poisoned_fleet(sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory,
                   count: int) -> str:
    workers = [sim_worker_factory(name=f"sim{i}", args=("--fault", f"poison:seed={POISON_SEED}"))
               for i in range(count)]
    return proxy_factory([(w.name, w.url) for w in workers]).url


def test_a_burst_of_30_poison_requests_opens_no_breaker_and_healthy_requests_are_served(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """30 batch-killers at once on 2 sims: each refused, then 5 healthy 200s, no breaker open."""
    url = poisoned_fleet(sim_worker_factory, proxy_factory, 2)
    with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(30) as pool:
        bad = set(pool.map(lambda _: client.post("/v1/completions", json=poison()).status_code,
                           range(30)))
        good = [client.post("/v1/completions", json=healthy()).status_code for _ in range(5)]
        assert bad <= {422, 502, 503}, bad
        assert breakers_open(client) == []
        assert good == [200] * 5
        assert breakers_open(client) == []


def test_poison_on_a_one_worker_fleet_leaves_its_breaker_closed(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """5 poison requests with no second opinion: each 422/502, the breaker stays closed."""
    url = poisoned_fleet(sim_worker_factory, proxy_factory, 1)
    with httpx.Client(base_url=url, timeout=60) as client:
        bad = [client.post("/v1/completions", json=poison()).status_code for _ in range(5)]
        good = [client.post("/v1/completions", json=healthy()).status_code for _ in range(5)]
        assert all(s in (422, 502) for s in bad), bad
        assert good == [200] * 5
        assert breakers_open(client) == []
