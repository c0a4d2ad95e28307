"""`ftctl inject` against real `ftctl sim` engines: each fault has its effect and reverts."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from dynamo_ftctl.faults.inject import InjectOptions, plan_injection, revert_pending, run_injection
from dynamo_ftctl.faults.injectors import Injectors
from dynamo_ftctl.gpu.kmsg import parse_xid_line
from dynamo_ftctl.inventory import Inventory, load_inventory
from dynamo_ftctl.openai import (
    StreamAccumulator,
    completion_request,
    iter_sse_events,
    parse_sse_event,
)

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"
BODY = completion_request(MODEL, "a long answer", max_tokens=40, temperature=0.0,
                          return_token_ids=True, extra={"ignore_eos": True})
FAULTS = "[kill, hang, slow, sdc, disconnect, xid48, xid63, net-latency]"


def _inventory(tmp_path: Path, worker: SimWorker, *, url: str | None = None,
               injectors: str = "[signal, http, kmsg]", netproxy: str | None = None) -> Inventory:
    net = f", netproxy: {netproxy}" if netproxy else ""
    path = tmp_path / "inv.yaml"
    path.write_text(f"""
cluster: t
workers:
  - name: w1
    url: {url or worker.url}
    model: {MODEL}
    admin: {{url: {worker.url}, token_env: FTCTL_TEST_ADMIN}}
    process: {{pid_file: {worker.pid_file}}}
    faults: {FAULTS}
    inject: {{injectors: {injectors}, kmsg_path: {tmp_path / 'kmsg.log'}{net}}}
""")
    return load_inventory(path)


def _injectors(worker: SimWorker) -> Injectors:
    return Injectors(environ={"FTCTL_TEST_ADMIN": worker.admin_token or ""})


def _stream(url: str, body: dict[str, Any] = BODY) -> StreamAccumulator:
    acc = StreamAccumulator()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=30) as response:
            for event in iter_sse_events(response.iter_raw()):
                acc.add(parse_sse_event(event))
    except httpx.RemoteProtocolError:
        pass
    return acc


@pytest.fixture
def worker(sim_worker_factory: Any, tmp_path: Path) -> SimWorker:
    """A fresh engine with a pid file (signal faults need it)."""
    return sim_worker_factory(name="inj", pid_file=tmp_path / "w1.pid")


def test_http_faults_have_their_effect_and_revert(worker: SimWorker, tmp_path: Path) -> None:
    """slow delays tokens, sdc changes them, disconnect cuts streams; each revert restores."""
    inv = _inventory(tmp_path, worker)
    common = {"injectors": _injectors(worker), "audit_log": tmp_path / "a.jsonl",
              "state_dir": tmp_path / "s"}
    clean = _stream(worker.url)
    assert clean.finished

    run_injection(plan_injection(inv, "w1", "sdc"), **common)
    corrupted = _stream(worker.url)
    assert corrupted.token_ids != clean.token_ids
    revert_pending(all_=True, **common)
    assert _stream(worker.url).token_ids == clean.token_ids

    run_injection(plan_injection(inv, "w1", "disconnect", InjectOptions(after_tokens=5)),
                  **common)
    cut = _stream(worker.url)
    assert cut.token_ids == clean.token_ids[:5]
    assert not cut.finished
    revert_pending(all_=True, **common)

    run_injection(plan_injection(inv, "w1", "slow", InjectOptions(delay_ms=30)), **common)
    started = time.monotonic()
    slow = _stream(worker.url, {**BODY, "max_tokens": 10})
    assert time.monotonic() - started >= 10 * 0.03 * 0.9
    assert slow.token_ids == clean.token_ids[:10]
    revert_pending(all_=True, **common)
    assert _stream(worker.url).token_ids == clean.token_ids


def test_xid48_logs_the_line_and_ends_the_engine(worker: SimWorker, tmp_path: Path) -> None:
    """xid48 writes a parseable kernel Xid line naming the engine's pid, then the engine dies."""
    inv = _inventory(tmp_path, worker)
    run_injection(plan_injection(inv, "w1", "xid48"), injectors=_injectors(worker),
                  audit_log=tmp_path / "a.jsonl", state_dir=tmp_path / "s")
    assert worker.wait_exit(timeout_s=20) not in (None, 0)
    line = (tmp_path / "kmsg.log").read_text().splitlines()[0]
    parsed = parse_xid_line(line)
    assert parsed is not None
    assert (parsed.xid, parsed.pid) == (48, worker.pid)
    assert "NVRM: Xid (PCI:0000:3b:00): 48" in worker.stderr_text()


def test_hang_by_signal_stops_serving_until_reverted(worker: SimWorker, tmp_path: Path) -> None:
    """hang SIGSTOPs the engine found by its pid file: /health times out; revert serves again."""
    inv = _inventory(tmp_path, worker)
    common = {"injectors": _injectors(worker), "audit_log": tmp_path / "a.jsonl",
              "state_dir": tmp_path / "s"}
    run_injection(plan_injection(inv, "w1", "hang"), **common)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{worker.url}/health", timeout=0.5)
    finally:
        revert_pending(all_=True, **common)
    assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200


@pytest.fixture
def netproxy(worker: SimWorker) -> Iterator[dict[str, str]]:
    """`ftctl inject netproxy` in front of the worker, as a real process; stopped at teardown."""
    upstream = worker.url.removeprefix("http://")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_ftctl", "inject", "netproxy", "--listen", "127.0.0.1:0",
         "--upstream", upstream], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(30), "netproxy did not print its address within 30 s"
        info = json.loads(proc.stdout.readline())
        yield {"url": f"http://{info['listen']}", "control": info["control"]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def _ttft(url: str) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={**BODY, "max_tokens": 2, "stream": True}, timeout=30) as response:
        for _ in response.iter_raw():
            break
    return time.perf_counter() - started


def test_net_latency_through_the_fault_proxy(worker: SimWorker, netproxy: dict[str, str],
                                            tmp_path: Path) -> None:
    """net-latency 100 ms on the worker's proxy delays its answers; the revert removes it."""
    inv = _inventory(tmp_path, worker, url=netproxy["url"], injectors="[http, net]",
                     netproxy=netproxy["control"])
    common = {"injectors": _injectors(worker), "audit_log": tmp_path / "a.jsonl",
              "state_dir": tmp_path / "s"}
    base = min(_ttft(netproxy["url"]) for _ in range(3))
    run_injection(plan_injection(inv, "w1", "net-latency", InjectOptions(delay_ms=100)),
                  **common)
    assert httpx.get(f"{netproxy['control']}/toxics").json()["toxics"][0]["latency_ms"] == 100
    slow = min(_ttft(netproxy["url"]) for _ in range(3))
    assert slow >= 0.1  # every answer now waits 100 ms in the proxy
    revert_pending(all_=True, **common)
    assert httpx.get(f"{netproxy['control']}/toxics").json()["toxics"] == []
    assert min(_ttft(netproxy["url"]) for _ in range(3)) < base + 0.05
    assert os.environ.get("FTCTL_TEST_ADMIN") is None  # the token never left the Injectors
