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

import pytest

from dynamo_ftctl.faults.inject import InjectOptions, plan_injection, revert_pending, run_injection
from dynamo_ftctl.faults.injectors import Injectors
from dynamo_ftctl.gpu.kmsg import parse_xid_line
from dynamo_ftctl.http1 import ConnectionBroken, NoConnection
from dynamo_ftctl.inventory import Inventory, load_inventory
from dynamo_ftctl.openai import (
    ApiError,
    StreamAccumulator,
    completion_request,
    iter_sse_events,
    parse_sse_event,
)
from dynamo_ftctl.process import FakeSpawner
from tests import fetch
from tests.simfaults import health_stalls
from tests.waiting import wait_until

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"
BODY = completion_request(MODEL, "a long answer", max_tokens=40, temperature=0.0,
                          return_token_ids=True, extra={"ignore_eos": True})
FAULTS = ("[kill, term, hang, slow, sdc, disconnect, thermal, ecc, overload, xid48, xid63, "
          "xid94, net-latency, net-bandwidth]")


def _inventory(tmp_path: Path, worker: SimWorker, *, url: str | None = None,
               injectors: str = "[signal, http, kmsg]", netproxy: str | None = None,
               gpus: str = "[]") -> Inventory:
    net = f", netproxy: {netproxy}" if netproxy else ""
    path = tmp_path / "inv.yaml"
    path.write_text(f"""
cluster: t
workers:
  - name: w1
    url: {url or worker.url}
    model: {MODEL}
    gpus: {gpus}
    admin: {{url: {worker.url}, token_env: FTCTL_TEST_ADMIN}}
    process: {{pid_file: {worker.pid_file}}}
    faults: {FAULTS}
    inject: {{injectors: {injectors}, kmsg_path: {tmp_path / 'kmsg.log'}{net}}}
""")
    return load_inventory(path)


NET_TOKEN = "net-test-token"


def _injectors(worker: SimWorker) -> Injectors:
    return Injectors(environ={"FTCTL_TEST_ADMIN": worker.admin_token or "",
                              "FTCTL_NETPROXY_TOKEN": NET_TOKEN})


def _stream_or_error(url: str, body: dict[str, Any] = BODY,
                     ) -> tuple[StreamAccumulator, str | None]:
    """A stream's tokens so far and the error event that ended it, if one did (a dropped
    connection just ends the stream)."""
    acc = StreamAccumulator()
    try:
        with fetch.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=30) as response:
            for event in iter_sse_events(response.iter_bytes()):
                acc.add(parse_sse_event(event))
    except ConnectionBroken:
        pass
    except ApiError as exc:
        return acc, str(exc)
    return acc, None


def _stream(url: str, body: dict[str, Any] = BODY) -> StreamAccumulator:
    return _stream_or_error(url, body)[0]


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
        with pytest.raises(TimeoutError):
            fetch.get(f"{worker.url}/health", timeout=0.5)
    finally:
        revert_pending(all_=True, **common)
    assert fetch.get(f"{worker.url}/health", timeout=10).status == 200


@pytest.fixture
def netproxy(worker: SimWorker) -> Iterator[dict[str, str]]:
    """`ftctl inject netproxy` in front of the worker, as a real process; stopped at teardown."""
    upstream = worker.url.removeprefix("http://")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_ftctl", "inject", "netproxy", "--listen", "127.0.0.1:0",
         "--upstream", upstream], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, "FTCTL_NETPROXY_TOKEN": NET_TOKEN},
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
    with fetch.stream("POST", f"{url}/v1/completions",
                      json={**BODY, "max_tokens": 2, "stream": True}, timeout=30) as response:
        for _ in response.iter_bytes():
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
    assert fetch.get(f"{netproxy['control']}/toxics").json()["toxics"][0]["latency_ms"] == 100
    slow = min(_ttft(netproxy["url"]) for _ in range(3))
    assert slow >= 0.1  # every answer now waits 100 ms in the proxy
    revert_pending(all_=True, **common)
    assert fetch.get(f"{netproxy['control']}/toxics").json()["toxics"] == []
    assert min(_ttft(netproxy["url"]) for _ in range(3)) < base + 0.05
    assert os.environ.get("FTCTL_TEST_ADMIN") is None  # the token never left the Injectors


def _common(worker: SimWorker, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"injectors": extra.pop("injectors", None) or _injectors(worker),
            "audit_log": tmp_path / "a.jsonl", "state_dir": tmp_path / "s", **extra}


def test_term_stops_the_engine_gracefully(worker: SimWorker, tmp_path: Path) -> None:
    """term SIGTERMs the engine from its pid file: it exits by itself; nothing to revert."""
    inv = _inventory(tmp_path, worker)
    plan = plan_injection(inv, "w1", "term")
    assert plan.reverts == ()
    result = run_injection(plan, **_common(worker, tmp_path))
    assert result.outcomes == ("sent SIGTERM",)
    assert worker.wait_exit(timeout_s=20) is not None
    with pytest.raises(NoConnection):
        fetch.get(f"{worker.url}/health", timeout=2)


def test_thermal_slows_tokens_sets_the_throttle_reason_and_reverts(
    worker: SimWorker, tmp_path: Path,
) -> None:
    """thermal: tokens slow down and dcgmi sets the HW thermal throttle reason; revert undoes both."""
    dcgmi = FakeSpawner()
    inv = _inventory(tmp_path, worker, injectors="[http, dcgm]", gpus="[3]")
    injectors = Injectors(environ={"FTCTL_TEST_ADMIN": worker.admin_token or ""},
                          spawner=dcgmi)
    common = _common(worker, tmp_path, injectors=injectors)
    quick = {**BODY, "max_tokens": 10}
    clean = _stream(worker.url, quick)
    run_injection(plan_injection(inv, "w1", "thermal", InjectOptions(delay_ms=40)), **common)
    started = time.monotonic()
    hot = _stream(worker.url, quick)
    assert time.monotonic() - started >= 10 * 0.04 * 0.9
    assert hot.token_ids == clean.token_ids  # slower, not wrong
    assert dcgmi.runs == [["dcgmi", "test", "--inject", "--gpuid", "3", "-f", "112", "-v", "64"]]
    auth = {"Authorization": f"Bearer {worker.admin_token}"}
    assert fetch.get(f"{worker.url}/admin/fault", timeout=5, headers=auth
                     ).json()["slow_delay_ms"] == 40
    revert_pending(all_=True, **common)
    assert dcgmi.runs[-1] == ["dcgmi", "test", "--inject", "--gpuid", "3", "-f", "112", "-v", "0"]
    # Fast again: the delay is gone (how fast a stream then runs is the scheduler's).
    assert fetch.get(f"{worker.url}/admin/fault", timeout=5, headers=auth
                     ).json()["slow_delay_ms"] == 0
    assert _stream(worker.url, quick).token_ids == clean.token_ids


def test_ecc_logs_a_row_remap_xid_and_serving_goes_on(worker: SimWorker, tmp_path: Path) -> None:
    """ecc writes a parseable Xid 63 line naming the engine; the engine keeps answering."""
    inv = _inventory(tmp_path, worker)
    plan = plan_injection(inv, "w1", "ecc")
    assert plan.reverts == ()
    run_injection(plan, **_common(worker, tmp_path))
    parsed = parse_xid_line((tmp_path / "kmsg.log").read_text().splitlines()[0])
    assert parsed is not None
    assert (parsed.xid, parsed.pid) == (63, worker.pid)
    assert _stream(worker.url).finished
    assert worker.alive


def test_xid94_ends_only_the_request_on_the_faulty_context(
    worker: SimWorker, tmp_path: Path,
) -> None:
    """xid94: of two concurrent streams one ends with an error, the other finishes; the engine
    stays up and logs the Xid line."""
    from concurrent.futures import ThreadPoolExecutor

    inv = _inventory(tmp_path, worker)
    common = _common(worker, tmp_path)
    clean = _stream(worker.url)
    # Slow tokens keep both streams in flight while the Xid arrives.
    run_injection(plan_injection(inv, "w1", "slow", InjectOptions(delay_ms=50)), **common)
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(_stream_or_error, worker.url) for _ in range(2)]
        wait_until(lambda: _metric(worker, "vllm:num_requests_running"), 20,
                   "two streams running at once", accept=lambda n: n >= 2, interval=0.02)
        result = run_injection(plan_injection(inv, "w1", "xid94"), **common)
        done = [f.result(timeout=60) for f in streams]
    assert result.plan.reverts == ()
    failed = [(acc, error) for acc, error in done if error is not None]
    finished = [acc for acc, error in done if error is None and acc.finished]
    assert len(failed) == 1
    assert len(finished) == 1
    assert finished[0].token_ids == clean.token_ids
    assert "Xid 94, contained" in str(failed[0][1])
    assert len(failed[0][0].token_ids) < len(clean.token_ids)
    revert_pending(all_=True, **common)
    assert _stream(worker.url).token_ids == clean.token_ids  # serving goes on
    assert worker.alive
    err = worker.stderr_text()
    assert f"NVRM: Xid (PCI:0000:3b:00): 94, pid={worker.pid}," in err
    parsed = parse_xid_line((tmp_path / "kmsg.log").read_text().splitlines()[0])
    assert parsed is not None
    assert parsed.xid == 94


def _metric(worker: SimWorker, name: str) -> float:
    text = fetch.get(f"{worker.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def test_hang_by_http_stalls_requests_but_not_the_loop(
    sim_worker_factory: Any, tmp_path: Path,
) -> None:
    """hang through the admin API: /health and streams stall while /admin/fault still answers;
    the revert resumes them and the stalled stream finishes intact."""
    from concurrent.futures import ThreadPoolExecutor

    worker = sim_worker_factory(name="hang-http")
    inv = _inventory(tmp_path, worker, injectors="[http]")
    common = _common(worker, tmp_path)
    clean = _stream(worker.url)
    auth = {"Authorization": f"Bearer {worker.admin_token}"}
    run_injection(plan_injection(inv, "w1", "slow", InjectOptions(delay_ms=20)), **common)
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(_stream, worker.url)
        wait_until(lambda: _metric(worker, "vllm:num_requests_running"), 20,
                   "the stream running", accept=lambda n: n >= 1, interval=0.02)
        run_injection(plan_injection(inv, "w1", "hang"), **common)
        wait_until(lambda: health_stalls(worker.url), 10, "/health to stall (no answer in 0.5 s)",
                   interval=0)
        state = fetch.get(f"{worker.url}/admin/fault", headers=auth, timeout=2).json()
        assert state["hung"] is True
        assert not stalled.done()
        revert_pending(all_=True, **common)
        assert fetch.get(f"{worker.url}/health", timeout=5).status == 200
        assert stalled.result(timeout=60).token_ids == clean.token_ids


def test_net_bandwidth_through_the_fault_proxy(worker: SimWorker, netproxy: dict[str, str],
                                               tmp_path: Path) -> None:
    """net-bandwidth 2 KiB/s on the worker's proxy slows a big answer to about that rate; the
    revert lifts the limit."""
    inv = _inventory(tmp_path, worker, url=netproxy["url"], injectors="[http, net]",
                     netproxy=netproxy["control"])
    common = _common(worker, tmp_path)
    body = {**BODY, "max_tokens": 64, "logprobs": 5}

    def download() -> tuple[int, float]:
        started = time.perf_counter()
        response = fetch.post(f"{netproxy['url']}/v1/completions", json=body, timeout=60)
        assert response.status == 200
        return len(response.body), time.perf_counter() - started

    size, _ = download()
    assert size > 8 * 1024  # big enough that 2 KiB/s takes seconds
    run_injection(plan_injection(inv, "w1", "net-bandwidth", InjectOptions(rate_kbps=2)),
                  **common)
    _, slow_s = download()
    assert slow_s >= size / (2 * 1024) * 0.8
    revert_pending(all_=True, **common)
    assert fetch.get(f"{netproxy['control']}/toxics").json()["toxics"] == []
    _, again_s = download()
    assert again_s < size / (2 * 1024) * 0.8  # faster than 2 KiB/s allows: the limit lifted


def test_overload_saturates_the_worker_and_revert_stops_the_load(
    sim_worker_factory: Any, tmp_path: Path,
) -> None:
    """overload starts a background load that queues requests on the worker (waiting > 0);
    the revert record names the load's pid, and the revert ends it and the queue drains."""
    worker = sim_worker_factory(name="overload", model_config="ftctl-sim-tiny-small-cache")
    inv = _inventory(tmp_path, worker)
    common = _common(worker, tmp_path)
    result = run_injection(plan_injection(
        inv, "w1", "overload", InjectOptions(rate=100, concurrency=40, state_dir=tmp_path / "s")),
        **common)
    assert result.pending_revert is not None
    record = json.loads(result.pending_revert.read_text())
    pid = int(record["outcomes"][0].split("pid ")[1].split()[0])
    assert Path(f"/proc/{pid}").exists()
    try:
        wait_until(lambda: _metric(worker, "vllm:num_requests_waiting"), 30,
                   "a request queued on the worker", accept=lambda n: n > 0, interval=0.05)
    finally:
        reverted = revert_pending(all_=True, **common)
    assert [r["fault"] for r in reverted.reverted] == ["overload"]
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    wait_until(lambda: _metric(worker, "vllm:num_requests_running") + _metric(
        worker, "vllm:num_requests_waiting"), 30, "the queue drained after the revert (the load "
        "gone)", accept=lambda n: n == 0, interval=0.1)
    actions = [json.loads(line)["action"] for line in (tmp_path / "a.jsonl").read_text()
               .splitlines()]
    assert actions == ["inject", "revert"]
