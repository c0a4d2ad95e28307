"""Admission against a real `ftctl sim`: no lock-in on retained KV, busy state without traffic,
shedding between two scrapes (issue 22)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from tests import fetch
from tests.integration.proxy.test_proxy_sim import (
    MODEL,
    ProxyFactory,
    gauge,
    proxy_factory,
    proxy_knows_max_len,
    set_fault,
    wait_until,
)

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration

__all__ = ["proxy_factory"]  # the fixture, shared with the sim-worker tests

SMALL_CACHE = "ftctl-sim-tiny-small-cache"  # 24 blocks of 16 tokens, 8 sequences
PROMPT_IDS = list(range(65, 97))  # 32 tokens: two blocks


def cut_stream(url: str, request_id: str, after_tokens: int) -> str:
    """Stream a long completion and hang up after `after_tokens` token events; the id the
    worker knows the request by (the proxy's `x-ftctl-upstream-id`)."""
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with fetch.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": request_id}) as resp:
        assert resp.status == 200, resp.read()
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen >= after_tokens:
                break  # leaving the block closes the connection: the client is gone
    return resp.headers["x-ftctl-upstream-id"]


def retained(worker: SimWorker, request_id: str) -> bool:
    """True while the worker still holds the KV of `request_id` for an export."""
    resp = fetch.get(f"{worker.url}/admin/kv/{request_id}", timeout=10,
                     headers={"Authorization": f"Bearer {worker.admin_token}"})
    return resp.status == 200


def test_retained_kv_of_gone_clients_does_not_lock_the_proxy_into_shedding(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """Clients cut off mid-stream fill the pool with retained KV; a new request is still admitted."""
    worker = sim_worker_factory(name="r0", model_config=SMALL_CACHE)
    set_fault(worker, {"kind": "slow", "delay_ms": 20})  # ~50 tokens/s: little overshoot
    proxy = proxy_factory([("r0", worker.url)])  # default thresholds (0.85)
    # Two clients leave after 135 tokens: 2 x (32 + 135..176) tokens = 2 x 11..12 of the
    # pool's 24 blocks are retained, 92-100% of it, above the threshold.
    with ThreadPoolExecutor(2) as pool:
        ids = [future.result(timeout=60) for future in
               [pool.submit(cut_stream, proxy.url, i, 135) for i in ("cut-0", "cut-1")]]
    wait_until(lambda: gauge(worker.url, "vllm:num_requests_running") == 0, 10,
               "the worker to drop the cut streams")
    assert all(retained(worker, i) for i in ids)  # what retention is for: the KV is there
    set_fault(worker, {"kind": "clear"})
    wait_until(lambda: proxy_knows_max_len(proxy), 10, "a scrape")
    time.sleep(0.3)  # a few more scrapes (every 0.1 s) of the idle, retaining worker
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    statuses: list[int] = []

    def admitted() -> bool:
        statuses.append(fetch.post(f"{proxy.url}/v1/completions", json=small,
                                   timeout=30).status)
        return statuses[-1] == 200

    # Well inside the sim's retention (60 s): refused until then is the lock-in.
    wait_until(admitted, 5, "a standard request to be admitted")
    assert statuses[0] == 200, statuses
    assert not fetch.get(f"{proxy.url}/health", timeout=5).json()["workers"]["r0"]["busy"]


def test_health_says_busy_while_requests_wait_in_the_engine(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """Requests queued in the engine make /health say busy with no admission since."""
    worker = sim_worker_factory(name="h0", model_config=SMALL_CACHE)
    set_fault(worker, {"kind": "slow", "delay_ms": 30})
    proxy = proxy_factory([("h0", worker.url)])
    wait_until(lambda: proxy_knows_max_len(proxy), 10, "a scrape")
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 100, "ignore_eos": True,
            "temperature": 0}
    with ThreadPoolExecutor(6) as pool:
        # All admitted at once while the worker is idle (6 x 2 blocks of prompt); they
        # grow to 9 blocks each in a 24-block pool, so the engine preempts and queues.
        futures = [pool.submit(fetch.post, f"{proxy.url}/v1/completions", json=body,
                               timeout=120) for _ in range(6)]
        wait_until(lambda: gauge(worker.url, "vllm:num_requests_waiting") > 0, 20,
                   "requests waiting in the engine")
        wait_until(lambda: fetch.get(f"{proxy.url}/health", timeout=5).json()
                   ["workers"]["h0"]["busy"], 3, "/health to say busy")
        assert gauge(proxy.url, 'ftctl_worker_busy{worker="h0"}') == 1
        set_fault(worker, {"kind": "clear"})
        assert all(f.result(timeout=120).status == 200 for f in futures)
    wait_until(lambda: not fetch.get(f"{proxy.url}/health", timeout=5).json()
               ["workers"]["h0"]["busy"], 5, "/health to say free again")


def test_shedding_starts_between_two_scrapes_once_the_worker_is_full(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """Under overload the proxy sheds (503) with no scrape of the worker since it was idle:
    its own count of what it admitted fills the pool. (When, to the millisecond, is the
    scheduler's; the scrape interval, 60 s, is longer than the whole overload.)"""
    worker = sim_worker_factory(name="s0", model_config=SMALL_CACHE)
    # Full for seconds, not for a moment a loaded test machine's watcher could miss.
    set_fault(worker, {"kind": "slow", "delay_ms": 30})
    # One scrape at start (the pool's size and an idle worker), none during the test.
    proxy = proxy_factory([("s0", worker.url)], scrape_interval_s=60,
                          busy={"active_decode_blocks_threshold": 0.85,
                                "active_prefill_tokens_threshold": 10**8})
    wait_until(lambda: proxy_knows_max_len(proxy), 10, "the first scrape")
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 96, "ignore_eos": True,
            "temperature": 0}
    start = time.monotonic()
    saturated: list[float] = []
    shed: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        usage = wait_until(
            lambda: stop.is_set() or gauge(worker.url, "vllm:kv_cache_usage_perc") > 0.85,
            120, "the worker full (KV usage past 0.85) or the overload over")
        if usage and not stop.is_set():
            saturated.append(time.monotonic() - start)

    def send() -> int:
        sent = time.monotonic() - start
        status = fetch.post(f"{proxy.url}/v1/completions", json=body, timeout=120).status
        if status == 503:
            shed.append(sent)
        return status

    futures: list[Future[int]] = []
    with ThreadPoolExecutor(40) as pool:
        watcher = pool.submit(watch)

        def one_more() -> list[float]:
            futures.append(pool.submit(send))
            return shed

        try:
            # ~20 requests/s of 8-block requests (3 s each) into a 24-block pool: many
            # times what it serves. Bounded: 10 s, or until the proxy sheds.
            wait_until(one_more, 10, "a 503 under overload", interval=0.05)
        finally:
            # The proxy may shed a little before the engine's own figure crosses (it
            # counts the requests queued there too); what it admitted fills the pool.
            statuses = [f.result(timeout=120) for f in futures]
            stop.set()
            watcher.result(timeout=30)
    assert saturated, f"the worker never filled ({statuses})"
    assert time.monotonic() - start < 60, "a second scrape could have come"
    assert set(statuses) <= {200, 503}
