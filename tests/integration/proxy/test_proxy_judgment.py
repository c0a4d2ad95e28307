"""Issue 29's judgment against real `ftctl sim` processes and the real `ftctl proxy`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import pytest

from dynamo_ftctl.http1 import Reply
from tests import fetch
from tests.conftest import SIM_ADMIN_TOKEN
from tests.integration.proxy.test_proxy_sim import MODEL, gauge, proxy_factory, wait_until

if TYPE_CHECKING:
    from tests.conftest import SimWorkerFactory
    from tests.integration.proxy.test_proxy_sim import ProxyFactory

__all__ = ["proxy_factory"]

pytestmark = pytest.mark.integration

POISON_SEED = 666  # the sims' poison fault: a request with this seed ends its whole batch


def healthy() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def poison() -> dict[str, Any]:
    return {**healthy(), "prompt": "poison", "max_tokens": 8, "seed": POISON_SEED,
            "temperature": 1}


def health(url: str) -> dict[str, Any]:
    """The /health document of the proxy at `url`."""
    doc: dict[str, Any] = fetch.get(f"{url}/health", timeout=60).json()
    return doc


def breakers_open(url: str) -> list[str]:
    workers = health(url).get("workers", {})
    return [n for n, w in workers.items() if isinstance(w, dict) and w.get("breaker") == "open"]


def post(url: str, body: dict[str, Any]) -> Reply:
    """A generation through the proxy at `url`, answered whole."""
    return fetch.post(f"{url}/v1/completions", json=body, timeout=60)


def poisoned_fleet(sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory,
                   count: int) -> str:
    workers = [sim_worker_factory(name=f"sim{i}", args=("--fault", f"poison:seed={POISON_SEED}"))
               for i in range(count)]
    return proxy_factory([(w.name, w.url) for w in workers]).url


def test_a_burst_of_30_poison_requests_opens_no_breaker_and_healthy_requests_are_served(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """30 batch-killers at once on 2 sims: each refused, then 5 healthy 200s, no breaker open."""
    url = poisoned_fleet(sim_worker_factory, proxy_factory, 2)
    with ThreadPoolExecutor(30) as pool:
        bad = set(pool.map(lambda _: post(url, poison()).status, range(30)))
        good = [post(url, healthy()).status for _ in range(5)]
        assert bad <= {422, 502, 503}, bad
        assert breakers_open(url) == []
        assert good == [200] * 5
        assert breakers_open(url) == []


def test_poison_on_a_one_worker_fleet_leaves_its_breaker_closed(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """5 poison requests with no second opinion: each 422/502, the breaker stays closed."""
    url = poisoned_fleet(sim_worker_factory, proxy_factory, 1)
    bad = [post(url, poison()).status for _ in range(5)]
    good = [post(url, healthy()).status for _ in range(5)]
    assert all(s in (422, 502) for s in bad), bad
    assert good == [200] * 5
    assert breakers_open(url) == []


class StandIn:
    """A loopback upstream answering every generation with `status` (empty body), or one
    token once `status` is 200; `requests` counts clients' requests (not the proxy's probes)."""

    def __init__(self, status: int, retry_after: str | None = None) -> None:
        self.status = status
        self.retry_after = retry_after
        self.requests = 0


@contextmanager
def stand_in(status: int, retry_after: str | None = None) -> Iterator[tuple[StandIn, str]]:
    state = StandIn(status, retry_after)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if b'"hello"' in body:
                state.requests += 1
            if state.status == 200:
                chunk = json.dumps({"id": "s", "object": "text_completion", "model": MODEL,
                                    "choices": [{"index": 0, "text": "a", "token_ids": [97],
                                                 "finish_reason": "length"}]})
                data = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
            else:
                data = b""
                self.send_response(state.status)
                if state.retry_after:
                    self.send_header("Retry-After", state.retry_after)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_429_with_retry_after_goes_elsewhere_or_reaches_the_client_and_moves_no_breaker(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """2 workers: 200s from the other; 1 worker: 429 with Retry-After; no breaker open."""
    sim = sim_worker_factory(name="sim")
    with stand_in(429, "30") as (_full, full_url):
        two = proxy_factory([("full", full_url), ("sim", sim.url)])
        assert [post(two.url, healthy()).status for _ in range(4)] == [200] * 4
        assert breakers_open(two.url) == []
        one = proxy_factory([("full", full_url)])
        answer = post(one.url, healthy())
        assert answer.status == 429
        assert 25 <= int(answer.headers["retry-after"]) <= 30
        assert breakers_open(one.url) == []


def test_a_frontend_answering_empty_404s_is_out_of_routing_and_back_once_it_serves(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """Dynamo 1.6's lease-expired frontend (a stand-in): all 200 from the sim, weight 0, back."""
    sim = sim_worker_factory(name="sim")
    with stand_in(404) as (empty, empty_url):
        url = proxy_factory([("empty", empty_url), ("sim", sim.url)]).url
        assert [post(url, healthy()).status for _ in range(6)] == [200] * 6
        view = health(url)["workers"]["empty"]
        assert view["weight"] == 0
        assert view["breaker"] == "closed"
        empty.status = 200
        wait_until(lambda: health(url)["workers"]["empty"]["weight"], 10,
                   "the frontend back in routing (weight > 0)", interval=0.05)


def streamed_text(url: str, body: dict[str, Any]) -> str:
    text = ""
    with fetch.stream("POST", f"{url}/v1/completions", json=body, timeout=90) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or ():
                    text += choice.get("text") or ""
    return text


def test_a_batch_killing_request_is_refused_and_the_streams_it_ended_continue_identically(
        sim_worker_factory: SimWorkerFactory, proxy_factory: ProxyFactory) -> None:
    """3 batch-killers amid 6 greedy streams on 2 sims: 422 each, 6 of 6 identical, no breaker."""
    workers = [sim_worker_factory(name=f"sim{i}", args=("--fault", f"poison:seed={POISON_SEED}"))
               for i in range(2)]
    url = proxy_factory([(w.name, w.url) for w in workers]).url
    body = {"model": MODEL, "prompt": "Tokens must not be lost", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    expected = fetch.post(f"{workers[0].url}/v1/completions", json={**body, "stream": False},
                          timeout=60).json()["choices"][0]["text"]
    for worker in workers:
        fetch.post(f"{worker.url}/admin/fault", json={"kind": "slow", "delay_ms": 30},
                   headers={"Authorization": f"Bearer {SIM_ADMIN_TOKEN}"}, timeout=5)
    with ThreadPoolExecutor(6) as pool:
        for _ in range(3):
            victims = [pool.submit(streamed_text, url, body) for _ in range(6)]
            wait_until(lambda: sum(gauge(w.url, "vllm:num_requests_running")
                                   for w in workers) >= 6, 20, "6 streams under way")
            assert post(url, poison()).status == 422
            assert [v.result(timeout=90) for v in victims] == [expected] * 6
        assert breakers_open(url) == []
