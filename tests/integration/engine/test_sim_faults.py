"""Admin faults, KV migration between two engines, sleep/wake and the local cluster, for real."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import pytest
from tests import fetch
from tests.simfaults import health_stalls
from tests.waiting import wait_until

from dynamo_ftctl.http1 import ConnectionBroken
from dynamo_ftctl.openai import (
    StreamAccumulator,
    completion_request,
    iter_sse_events,
    parse_sse_event,
)

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker
    from dynamo_ftctl.http1 import Reply

pytestmark = pytest.mark.integration
MODEL = "ftctl-sim-tiny"
LONG = completion_request(MODEL, "a long answer", max_tokens=60, temperature=0.8, seed=3,
                          return_token_ids=True, extra={"ignore_eos": True})


def admin(worker: SimWorker, body: dict[str, Any], token: str | None = "default") -> Reply:
    """POST a fault with the worker's bearer token (or the given one, or none)."""
    token = worker.admin_token if token == "default" else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return fetch.post(f"{worker.url}/admin/fault", json=body, headers=headers, timeout=10)


def stream_ids(worker: SimWorker, body: dict[str, Any], *, limit: int | None = None,
               headers: dict[str, str] | None = None) -> StreamAccumulator:
    """Stream a completion; stop reading after `limit` tokens; a dropped stream just ends."""
    acc = StreamAccumulator()
    try:
        with fetch.stream("POST", f"{worker.url}/v1/completions", json={**body, "stream": True},
                          headers=headers, timeout=30) as response:
            for event in iter_sse_events(response.iter_bytes()):
                acc.add(parse_sse_event(event))
                if limit is not None and len(acc.token_ids) >= limit:
                    break
    except ConnectionBroken:
        pass  # the server dropped the connection mid-stream
    return acc


def test_admin_auth(sim_worker_factory: Any) -> None:
    """No token configured: 403; token configured: 401 without or with a wrong one, 200 with it."""
    open_worker = sim_worker_factory(name="noauth", env={"FTCTL_ADMIN_TOKEN": ""},
                                     admin_token="")
    assert admin(open_worker, {"kind": "clear"}).status == 403
    worker = sim_worker_factory(name="auth")
    assert admin(worker, {"kind": "clear"}, token=None).status == 401
    assert admin(worker, {"kind": "clear"}, token="wrong").status == 401
    assert admin(worker, {"kind": "clear"}).status == 200
    assert admin(worker, {"kind": "melt"}).status == 400


def test_disconnect_slow_sdc_and_clear(sim_worker: SimWorker) -> None:
    """disconnect drops each stream after N tokens; slow delays tokens; sdc changes them; clear."""
    clean = stream_ids(sim_worker, LONG)
    assert clean.finished
    assert admin(sim_worker, {"kind": "disconnect", "after_tokens": 7}).status == 200
    dropped = stream_ids(sim_worker, LONG)
    assert dropped.token_ids == clean.token_ids[:7]
    assert not dropped.finished
    assert not dropped.done
    admin(sim_worker, {"kind": "clear"})
    admin(sim_worker, {"kind": "slow", "delay_ms": 40})
    started = time.monotonic()
    slow = stream_ids(sim_worker, {**LONG, "max_tokens": 10})
    assert time.monotonic() - started >= 10 * 0.04 * 0.9  # a lower bound: sleeps only add
    assert slow.token_ids == clean.token_ids[:10]
    admin(sim_worker, {"kind": "clear"})
    admin(sim_worker, {"kind": "sdc"})
    corrupted = stream_ids(sim_worker, LONG)
    assert corrupted.finished
    assert corrupted.token_ids != clean.token_ids
    admin(sim_worker, {"kind": "clear"})
    assert stream_ids(sim_worker, LONG).token_ids == clean.token_ids


def test_crash_logs_an_xid_and_exits(sim_worker: SimWorker) -> None:
    """crash: the process exits non-zero after an NVRM Xid 48 line and a CUDA error on stderr."""
    assert admin(sim_worker, {"kind": "crash", "xid": 48}).status == 200
    code = sim_worker.wait_exit(timeout_s=20)
    assert code not in (None, 0)
    err = sim_worker.stderr_text()
    assert f"NVRM: Xid (PCI:0000:3b:00): 48, pid={sim_worker.pid}," in err
    assert "CUDA error" in err


def test_hang_stops_answering_but_lives(sim_worker: SimWorker) -> None:
    """hang: /health times out while the process stays alive (SIGKILL ends it)."""
    assert admin(sim_worker, {"kind": "hang"}).status == 200
    wait_until(lambda: health_stalls(sim_worker.url), 10,
               "/health to stall (no answer in 0.5 s)", interval=0)
    assert sim_worker.alive
    sim_worker.kill()


def test_kv_migration_between_workers(sim_worker_factory: Any) -> None:
    """Export a live request from A, import on B: the tokens continue exactly; corruption fails."""
    a = sim_worker_factory(name="a")
    b = sim_worker_factory(name="b")
    auth = {"Authorization": f"Bearer {a.admin_token}"}
    reference = stream_ids(b, LONG)
    assert admin(a, {"kind": "slow", "delay_ms": 20}).status == 200  # keep it running
    head = stream_ids(a, LONG, limit=15, headers={"X-Request-Id": "move-me"})
    blob = fetch.get(f"{a.url}/admin/kv/move-me?abort=true", headers=auth, timeout=10)
    assert blob.status == 200
    assert blob.body[:4] == b"FTKV"
    from dynamo_ftctl.kv.wire import decode_kv

    exported = decode_kv(blob.body).header
    generated = list(exported.token_ids[exported.prompt_len:])
    assert generated[:15] == head.token_ids
    resumed = fetch.post(f"{b.url}/admin/kv/import?stream=false", content=blob.body,
                         headers=auth, timeout=30)
    assert resumed.status == 200, resumed.text
    rest = resumed.json()["choices"][0]["token_ids"]
    assert generated + rest == reference.token_ids
    corrupted = bytearray(blob.body)
    corrupted[-50] ^= 0xFF
    bad = fetch.post(f"{b.url}/admin/kv/import", content=bytes(corrupted), headers=auth,
                     timeout=10)
    assert bad.status == 400
    assert "is corrupted" in bad.json()["error"]["message"]


def test_sleep_and_wake(sim_worker: SimWorker) -> None:
    """Asleep: /health and requests answer 503; after /wake_up the same outputs return."""
    body = {**LONG, "max_tokens": 5}
    auth = {"Authorization": f"Bearer {sim_worker.admin_token}"}
    before = fetch.post(f"{sim_worker.url}/v1/completions", json=body, timeout=30).json()
    assert fetch.post(f"{sim_worker.url}/sleep?level=1", headers=auth,
                      timeout=10).status == 200
    assert fetch.get(f"{sim_worker.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    assert fetch.get(f"{sim_worker.url}/health", timeout=10).status == 503
    assert fetch.post(f"{sim_worker.url}/v1/completions", json=body,
                      timeout=10).status == 503
    assert fetch.post(f"{sim_worker.url}/wake_up", timeout=10).status == 401
    assert fetch.post(f"{sim_worker.url}/wake_up", headers=auth, timeout=10).status == 200
    after = fetch.post(f"{sim_worker.url}/v1/completions", json=body, timeout=30).json()
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


@pytest.mark.parametrize(("headers", "params"), [
    ({}, {}),
    ({"Authorization": "Bearer wrong"}, {}),
    ({"Authorization": "default"}, {}),
    ({"X-Admin-Token": "default"}, {}),
    ({}, {"token": "default"}),
])
def test_sleep_and_wake_need_the_admin_token(sim_worker: SimWorker, headers: dict[str, str],
                                             params: dict[str, str]) -> None:
    """/sleep without the bearer token (or with it in the wrong place) is a 401 and leaves a
    stream in flight untouched; `bearer` in lower case is accepted."""
    token = sim_worker.admin_token or ""
    headers = {k: token if v == "default" else v for k, v in headers.items()}
    params = {k: token if v == "default" else v for k, v in params.items()}
    body = {**LONG, "max_tokens": 30, "stream": True}
    with fetch.stream("POST", f"{sim_worker.url}/v1/completions", json=body,
                      timeout=30) as response:
        events = iter_sse_events(response.iter_bytes())
        acc = StreamAccumulator()
        acc.add(parse_sse_event(next(events)))  # the stream is running
        for path in ("/sleep", "/wake_up"):
            query = f"?{urlencode(params)}" if params else ""
            denied = fetch.post(f"{sim_worker.url}{path}{query}", headers=headers, timeout=10)
            assert denied.status == 401, path
            assert denied.header("www-authenticate") == "Bearer"
        for event in events:
            acc.add(parse_sse_event(event))
    assert acc.finished
    assert len(acc.token_ids) == 30
    assert fetch.get(f"{sim_worker.url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    lower = {"authorization": f"bearer {token}"}
    assert fetch.post(f"{sim_worker.url}/sleep", headers=lower, timeout=10).status == 200
    assert fetch.post(f"{sim_worker.url}/wake_up", headers=lower, timeout=10).status == 200


def test_sleep_is_refused_without_a_configured_token(sim_worker_factory: Any) -> None:
    """An engine with no admin token answers 403 to /sleep and /wake_up and stays awake."""
    worker = sim_worker_factory(name="noauth", env={"FTCTL_ADMIN_TOKEN": ""}, admin_token="")
    for path in ("/sleep?level=1", "/wake_up"):
        refused = fetch.post(f"{worker.url}{path}", headers={"Authorization": "Bearer x"},
                             timeout=10)
        assert refused.status == 403, path
    assert fetch.get(f"{worker.url}/health", timeout=10).status == 200


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_cluster_start_stop_and_failure(tmp_path: Path) -> None:
    """start_cluster brings up launch.sim workers with pid files; stop_cluster ends them;
    a worker that cannot start is named in the error."""
    from dynamo_ftctl.engine.launcher import start_cluster, stop_cluster
    from dynamo_ftctl.errors import Unreachable
    from dynamo_ftctl.inventory import load_inventory

    ports = [_free_port(), _free_port()]
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "cluster: t\nworkers:\n" + "".join(
            f"  - {{name: w{i}, url: 'http://127.0.0.1:{p}', model: {MODEL}, "
            f"launch: {{sim: {{seed: 0}}}}}}\n" for i, p in enumerate(ports)))
    inventory = load_inventory(inv)
    cluster = start_cluster(inventory, state_dir=tmp_path / "state", timeout_s=90)
    try:
        for i, port in enumerate(ports):
            assert fetch.get(f"http://127.0.0.1:{port}/health", timeout=10).status == 200
            pid = int((tmp_path / "state" / f"w{i}.pid").read_text())
            assert pid == cluster[f"w{i}"].pid
        result = stop_cluster(inventory, state_dir=tmp_path / "state", timeout_s=10)
        assert sorted(result.stopped + result.killed) == ["w0", "w1"]
        for worker in cluster:
            assert worker.wait_exit(10) is not None
    finally:
        cluster.stop(timeout_s=2)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"cluster: t2\nworkers:\n  - {{name: broken, url: 'http://127.0.0.1:{_free_port()}', "
        f"model: {MODEL}, launch: {{sim: {{model_config: missing.yaml}}}}}}\n")
    with pytest.raises(Unreachable, match="worker broken did not come up"):
        start_cluster(load_inventory(bad), state_dir=tmp_path / "s2", timeout_s=60)


def test_inject_kill_finds_a_sim_cluster_worker_by_its_pid_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ftctl inject kill --worker w3` against the cluster `start_cluster` (what `ftctl sim
    cluster` runs) started: the pid comes from the cluster's own pid file, the worker dies."""
    import subprocess
    import sys

    from dynamo_ftctl.engine.launcher import start_cluster
    from dynamo_ftctl.inventory import load_inventory

    monkeypatch.setenv("FTCTL_STATE_DIR", str(tmp_path / "state"))
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        f"cluster: c\nworkers:\n  - {{name: w3, url: 'http://127.0.0.1:{_free_port()}', "
        f"model: {MODEL}, launch: {{sim: {{seed: 0}}}}, faults: [kill]}}\n")
    with start_cluster(load_inventory(inv), timeout_s=90) as cluster:
        worker = cluster["w3"]
        assert (tmp_path / "state" / "c" / "w3.pid").read_text().strip() == str(worker.pid)
        done = subprocess.run(
            [sys.executable, "-m", "dynamo_ftctl", "-i", str(inv), "inject", "kill", "--worker",
             "w3", "--yes", "--audit-log", str(tmp_path / "audit.jsonl"), "--state-dir",
             str(tmp_path / "inject-state")],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
        assert done.returncode == 0, done.stderr
        assert worker.wait_exit(10) is not None
