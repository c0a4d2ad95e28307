"""`ftctl proxy --procs 2` as real processes on loopback: one port, one fleet view, one /metrics."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_ftctl.http1 import ConnectError, Reply
from tests import fetch
from tests.integration.proxy.test_proxy_process import TOKENS, paced_worker
from tests.integration.proxy.test_proxy_sim import (
    MODEL,
    ProxyFactory,
    ProxyProcess,
    proxy_factory,
    wait_until,
)
from tests.reaper import process_exists

pytestmark = pytest.mark.integration

__all__ = ["proxy_factory"]  # the fixture, shared with the other proxy tests

GENERATION = {"model": MODEL, "prompt": "hello", "max_tokens": TOKENS}


def _closed_port() -> str:
    """The URL of a loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _health_by_pid(url: str, pids: int, deadline_s: float = 15.0) -> dict[int, dict]:
    """GET /health on new connections until `pids` processes have answered; their docs."""
    seen: dict[int, dict] = {}

    def more() -> bool:
        # A new connection (fetch keeps none): the kernel picks a child.
        doc = fetch.get(f"{url}/health", timeout=5).json()
        seen[doc["pid"]] = doc
        return len(seen) >= pids

    wait_until(more, deadline_s, f"{pids} proxy processes answering /health")
    return seen


def _on_one_connection(url: str, *requests: tuple[str, str, Any]) -> list[Reply]:
    """(method, path, JSON body or None) requests sent in turn on one kept-alive
    connection: the process that answers the first answers them all."""

    async def send() -> list[Reply]:
        async with fetch.Session(url, timeout=10) as session:
            return [await session.request(method, path, json=body)
                    for method, path, body in requests]

    return asyncio.run(send())


def _metrics_dir(pid: int) -> Path:
    """The multiprocess metrics directory holding `pid`'s files (the parent made it)."""
    found = [path.parent for path in
             Path(tempfile.gettempdir()).glob(f"ftctl-proxy-metrics-*/*_{pid}.db")]
    assert len(found) >= 1, f"no metrics files of {pid}"
    return found[0]


def _sample(page: str, name: str) -> float | None:
    for line in page.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def _dead_worker_proxy(proxy_factory: ProxyFactory) -> ProxyProcess:
    return proxy_factory([("dead", _closed_port())], procs=2, breaker_threshold=1)


def test_two_processes_serve_one_port(proxy_factory: ProxyFactory) -> None:
    """With --procs 2 both processes answer on the one port, and generations go through."""
    with paced_worker() as worker:
        proxy = proxy_factory([("w0", worker)], procs=2)
        assert "(2 processes)" in proxy.log_text()
        docs = _health_by_pid(proxy.url, 2)
        assert proxy.proc.pid not in docs  # the parent serves nothing
        for _ in range(4):
            reply = fetch.post(f"{proxy.url}/v1/completions", json=GENERATION, timeout=10)
            assert reply.status == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == TOKENS


def test_a_breaker_opened_in_one_process_is_open_in_the_other(
        proxy_factory: ProxyFactory) -> None:
    """One failed request (threshold 1) opens the worker's breaker in both processes."""
    proxy = _dead_worker_proxy(proxy_factory)
    _health_by_pid(proxy.url, 2)  # both up, breakers closed
    # One request, so one process saw the failure.
    assert fetch.post(f"{proxy.url}/v1/completions", json=GENERATION, timeout=10).status >= 500

    def both_open() -> bool:
        docs = _health_by_pid(proxy.url, 2)
        return all(d["workers"]["dead"]["breaker"] == "open" for d in docs.values())

    wait_until(both_open, 15.0, "the breaker open in both processes")


def test_metrics_sum_over_processes(proxy_factory: ProxyFactory) -> None:
    """/metrics from either process counts the rejections both made; gauges appear once."""
    proxy = _dead_worker_proxy(proxy_factory)
    fetch.post(f"{proxy.url}/v1/completions", json=GENERATION, timeout=10)  # opens the breaker
    wait_until(lambda: all(d["degradation_level"] == 4
                           for d in _health_by_pid(proxy.url, 2).values()),
               15.0, "level 4 in both processes")
    served: dict[int, int] = {}

    def reject_on_both() -> bool:
        # /health names the process of this connection.
        health, answer = _on_one_connection(proxy.url, ("GET", "/health", None),
                                            ("POST", "/v1/completions", GENERATION))
        pid = health.json()["pid"]
        assert answer.status == 503
        served[pid] = served.get(pid, 0) + 1
        return len(served) == 2 and min(served.values()) >= 3

    wait_until(reject_on_both, 30.0, "rejections served by both processes")
    total = sum(served.values())
    name = 'ftctl_proxy_rejected_requests_total{priority="standard",reason="no_healthy_worker"}'
    pages: dict[int, str] = {}

    def page_from_both() -> bool:
        health, page = _on_one_connection(proxy.url, ("GET", "/health", None),
                                          ("GET", "/metrics", None))
        pages[health.json()["pid"]] = page.text
        return len(pages) == 2

    wait_until(page_from_both, 15.0, "/metrics from both processes")
    for page in pages.values():
        assert _sample(page, name) == total
        assert _sample(page, 'ftctl_circuit_breaker_state{worker="dead"}') == 1
        assert page.count('ftctl_circuit_breaker_state{') == 1  # one series, not one per pid
        assert _sample(page, "ftctl_proxy_degradation_level") == 4


def test_sigterm_stops_every_process_and_removes_the_metrics_dir(
        proxy_factory: ProxyFactory) -> None:
    """SIGTERM to the parent: it exits 0, its children are gone, so is their metrics dir."""
    proxy = _dead_worker_proxy(proxy_factory)
    children = list(_health_by_pid(proxy.url, 2))
    metrics_dir = _metrics_dir(children[0])
    assert metrics_dir.is_dir()
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(10) == 0
    assert not any(process_exists(pid) for pid in children)
    assert not metrics_dir.exists()


def test_sighup_keeps_the_parent_and_every_child(proxy_factory: ProxyFactory) -> None:
    """SIGHUP to the parent (it killed it, and its children with it): it is forwarded, each
    child reloads the inventory, and the same two children go on serving."""
    proxy = _dead_worker_proxy(proxy_factory)
    children = set(_health_by_pid(proxy.url, 2))
    proxy.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: proxy.log_text().count("inventory reloaded") == 2, 10.0,
               "both children to reload")
    assert set(_health_by_pid(proxy.url, 2)) == children
    assert proxy.proc.poll() is None


def test_a_child_that_dies_is_restarted(proxy_factory: ProxyFactory) -> None:
    """SIGKILL to one child: the parent forks another; two processes serve again."""
    proxy = _dead_worker_proxy(proxy_factory)
    children = list(_health_by_pid(proxy.url, 2))
    victim = children[0]
    started = time.monotonic()
    # The parent restarts a child that lived 1 s (an earlier death is a crash at start-up).
    wait_until(lambda: time.monotonic() - started > 1.2, 5.0, "the children past start-up")
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        try:
            docs = _health_by_pid(proxy.url, 2)
        except ConnectError:
            # A connection the kernel had queued on the killed child's socket is reset
            # (SO_REUSEPORT: one accept queue per listener; net.ipv4.tcp_migrate_req=0).
            return False
        return victim not in docs

    wait_until(replaced, 20.0, "a new child in place of the killed one")
    assert proxy.proc.poll() is None


def test_the_procs_flag_and_sigint(tmp_path: Path) -> None:
    """`--procs 2` on the command line starts two processes; SIGINT stops all with 130."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({
        "cluster": "procs-flag", "workers": [{"name": "w", "url": _closed_port(),
                                              "model": MODEL}],
        "proxy": {"listen": "127.0.0.1:0"}}))
    log = tmp_path / "proxy.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory),
                                 "proxy", "--procs", "2"], stdout=subprocess.DEVNULL,
                                stderr=sink)
    try:
        proxy = ProxyProcess(url="", proc=proc, log=log)
        wait_until(lambda: "(2 processes)" in proxy.log_text() or proc.poll() is not None,
                   30.0, "the proxy's serving line")
        url = re.search(r"on (http://\S+)", proxy.log_text())
        assert url is not None, proxy.log_text()
        children = list(_health_by_pid(url.group(1), 2))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
        assert not any(process_exists(pid) for pid in children)
    finally:
        ProxyProcess(url="", proc=proc, log=log).stop()


def test_a_second_proxy_cannot_share_the_port(proxy_factory: ProxyFactory,
                                              tmp_path: Path) -> None:
    """A second `--procs 2` proxy on a port the first serves exits 2 instead of sharing it."""
    proxy = _dead_worker_proxy(proxy_factory)
    inventory = tmp_path / "second.yaml"
    listen = proxy.url.removeprefix("http://")
    inventory.write_text(yaml.safe_dump({
        "cluster": "second", "workers": [{"name": "w", "url": _closed_port(), "model": MODEL}],
        "proxy": {"listen": listen, "procs": 2}}))
    second = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "proxy"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 2, second.stderr
    assert "cannot listen there" in second.stderr


def test_sigterm_lets_streams_in_flight_finish(proxy_factory: ProxyFactory) -> None:
    """SIGTERM mid-stream: the child serving it sends every token and [DONE]; exit 0."""
    with paced_worker() as worker:
        proxy = proxy_factory([("w0", worker)], procs=2)
        body = {**GENERATION, "stream": True, "temperature": 0}
        events: list[str] = []
        with fetch.stream("POST", f"{proxy.url}/v1/completions", json=body,
                          timeout=10) as reply:
            assert reply.status == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        proxy.proc.send_signal(signal.SIGTERM)
                    events.append(line)
        assert len(events) == TOKENS + 1
        assert events[-1] == "data: [DONE]"
        assert proxy.proc.wait(10) == 0
