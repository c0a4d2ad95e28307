"""EtcdLock against a real etcd (Debian `etcd-server`) on free loopback ports."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.errors import LockTimeout
from dynamo_ftctl.http1 import BlockingClient, ConnectError, MockTransport, Reply, Request
from dynamo_ftctl.lock import EtcdLock, LeaseLost
from tests import fetch
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None,
                       reason="etcd binary missing (Debian package etcd-server; make debs)"),
]

TTL = 2  # etcd's smallest useful lease TTL (its minimum is 1.5 x the election timeout)

HOLDER = """
import sys
from dynamo_ftctl.lock import EtcdLock
lock = EtcdLock([sys.argv[1]], sys.argv[2], 7, ttl_s=float(sys.argv[3]))
print(lock.acquire(30).token, flush=True)
sys.stdin.read()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """A single-member etcd on free loopback ports with a temp data dir; killed at teardown."""
    client, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = (tmp_path / "etcd.log").open("wb")
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"t={peer_url}", "--log-level", "error"],
        stdout=log, stderr=log,
    )
    try:
        def health() -> object:
            assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            return fetch.get(f"{client_url}/health", timeout=1).json().get("health")

        wait_until(health, 30, "etcd healthy", accept=lambda h: h == "true",
                   ignore=(OSError, ValueError), interval=0.05)
        yield client_url
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


class Partition:
    """The real blocking client behind a `MockTransport`, cut off for keep-alives like a
    network partition."""

    def __init__(self) -> None:
        self.cut = threading.Event()
        self.client = BlockingClient()
        self.transport = MockTransport(self.handle)

    def handle(self, request: Request) -> Reply:
        if self.cut.is_set() and request.url.endswith("/v3/lease/keepalive"):
            msg = "partitioned"
            raise ConnectError(msg)
        return self.client.handle_request(request)


def test_acquire_release_and_tokens_are_create_revisions(etcd: str) -> None:
    """Acquire writes the key with a lease; the token is its create revision and grows."""
    lock = EtcdLock([etcd], "/t/a", 3, ttl_s=TTL)
    lease = lock.acquire(timeout=5)
    owner = lock.owner()
    assert owner is not None
    assert (owner.live, owner.engine_id, owner.token) == (True, 3, lease.token)
    assert lock.is_held
    lock.release()
    assert lock.owner() is None
    again = lock.acquire(timeout=5)
    assert again.token > lease.token
    lock.close()


def test_contention_times_out_then_wakes_on_release(etcd: str) -> None:
    """A second engine times out (exit 4) while the key is held and is woken by its deletion."""
    first = EtcdLock([etcd], "/t/b", 0, ttl_s=TTL)
    second = EtcdLock([etcd], "/t/b", 1, ttl_s=TTL)
    first_lease = first.acquire(5)
    with pytest.raises(LockTimeout) as info:
        second.acquire(timeout=0.3)
    assert "engine 0" in str(info.value)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(second.acquire(10).token))
    thread.start()
    first.close()
    thread.join(15)
    assert len(got) == 1
    assert got[0] > first_lease.token
    second.close()


def test_killed_holder_lease_expires_and_waiter_acquires_within_ttl(etcd: str) -> None:
    """SIGKILL of the holding process: its lease expires and the waiter holds within TTL + 1 s."""
    with subprocess.Popen([sys.executable, "-c", HOLDER, etcd, "/t/c", str(TTL)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            token = int(holder.stdout.readline())
            waiter = EtcdLock([etcd], "/t/c", 1, ttl_s=TTL)
            with pytest.raises(LockTimeout):
                waiter.acquire(timeout=0.1)
            holder.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            lease = waiter.acquire(timeout=TTL + 5)
            took = time.monotonic() - killed
        finally:
            holder.kill()
            holder.wait(10)
    assert took <= TTL + 1, took
    assert lease.token > token
    waiter.close()


def test_partitioned_holder_is_refused_once_a_waiter_holds_the_key(etcd: str) -> None:
    """With keep-alives cut, once a waiter gets the key the old holder's ensure_held
    refuses, and its on_lost callback is told."""
    partition = Partition()
    told: list[tuple[float, LeaseLost]] = []
    holder = EtcdLock([etcd], "/t/d", 0, ttl_s=TTL, transport=partition.transport,
                      on_lost=lambda exc: told.append((time.monotonic(), exc)))
    old = holder.acquire(5)
    waiter = EtcdLock([etcd], "/t/d", 1, ttl_s=TTL)
    partition.cut.set()
    lease = waiter.acquire(timeout=TTL * 3)
    # The fencing promise, whatever the scheduler does: from the moment another engine
    # holds the key, the old holder's ensure_held refuses (it checks its own deadline,
    # which passes before etcd can expire the lease); the watchdog's callback comes too.
    with pytest.raises(LeaseLost):
        holder.ensure_held()
    assert not holder.is_held
    assert lease.token > old.token
    wait_until(lambda: told, 10, "the holder's on_lost callback")
    waiter.close()
    holder.close()


def test_cli_status_with_etcd_backend(etcd: str) -> None:
    """`ftctl lock status --backend etcd` exits 0 while held, 1 when free."""
    argv = [sys.executable, "-m", "dynamo_ftctl", "lock", "status", "--backend", "etcd",
            "--endpoint", etcd, "--key", "/t/e"]
    assert subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 1
    lock = EtcdLock([etcd], "/t/e", 2, ttl_s=TTL)
    lock.acquire(5)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0
    assert "engine 2" in proc.stdout
    lock.close()


def test_cli_acquire_runs_the_command_holding_the_lease(etcd: str) -> None:
    """`lock acquire --backend etcd -- CMD` holds the key while CMD runs and frees it after."""
    status = (f"{sys.executable} -m dynamo_ftctl lock status --backend etcd --endpoint {etcd} "
              "--key /t/f; echo rc=$?")
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "lock", "acquire", "--backend", "etcd",
         "--endpoint", etcd, "--key", "/t/f", "--ttl", str(TTL), "--", "sh", "-c", status],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rc=0" in proc.stdout
    probe = EtcdLock([etcd], "/t/f")
    assert probe.owner() is None
    probe.close()


TRAPPER = """
import signal, sys, time
def bye(signum, _frame):
    print("got", signal.Signals(signum).name, flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
deadline = time.monotonic() + 50
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(9)
"""


HoldCli = Callable[[str, str], subprocess.Popen[str]]


@pytest.fixture
def hold_cli(etcd: str) -> Iterator[HoldCli]:
    """Start `lock acquire --backend etcd --key KEY -- python -c SCRIPT` once SCRIPT said
    "ready" (it runs holding the lease); killed at teardown if still running."""
    started: list[subprocess.Popen[str]] = []

    def start(key: str, script: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", "lock", "acquire", "--backend", "etcd",
             "--endpoint", etcd, "--key", key, "--ttl", str(TTL), "--",
             sys.executable, "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"  # the child runs, holding the lease
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize(("script", "code", "said"), [
    (TRAPPER, 7, "got SIGTERM"),
    ("import time\nprint('ready', flush=True)\ntime.sleep(50)", 128 + signal.SIGTERM, None),
])
def test_cli_acquire_forwards_sigterm_to_the_command(
    etcd: str, hold_cli: HoldCli, script: str, code: int, said: str | None,
) -> None:
    """SIGTERM to `lock acquire --backend etcd -- CMD` reaches CMD; ftctl exits with CMD's status."""
    proc = hold_cli("/t/sig", script)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    if said:
        assert said in out
    probe = EtcdLock([etcd], "/t/sig")
    assert probe.owner() is None  # released on the way out
    probe.close()


def delete_key(etcd: str, key: str) -> None:
    """`etcdctl del KEY`, through the JSON gateway."""
    body = {"key": base64.b64encode(key.encode()).decode()}
    request = Request("POST", f"{etcd}/v3/kv/deleterange", json.dumps(body).encode(),
                      {"Content-Type": "application/json"}, timeout_s=5)
    assert BlockingClient().handle_request(request).status == 200


def test_deleted_key_tells_the_holder_and_the_next_token_is_higher(etcd: str) -> None:
    """The key deleted under its holder (etcdctl del): the holder is told within about TTL/3,
    and the engine that takes the key gets a higher token."""
    told = threading.Event()
    holder = EtcdLock([etcd], "/t/del", 0, ttl_s=TTL, on_lost=lambda _exc: told.set())
    old = holder.acquire(5)
    deleted_at = time.monotonic()
    delete_key(etcd, "/t/del")
    waiter = EtcdLock([etcd], "/t/del", 1, ttl_s=TTL)
    assert waiter.acquire(5).token > old.token
    assert told.wait(TTL * 3), "the holder was never told"
    assert time.monotonic() - deleted_at < TTL * 2
    assert not holder.is_held
    with pytest.raises(LeaseLost, match="lost the lock"):
        holder.ensure_held()
    waiter.close()
    holder.close()


def test_cli_acquire_stops_the_command_when_the_key_is_deleted(
    etcd: str, hold_cli: HoldCli,
) -> None:
    """`lock acquire --backend etcd -- CMD` and the key deleted: CMD gets SIGTERM, ftctl exits 5
    with one line saying the lock was lost."""
    proc = hold_cli("/t/cmd", TRAPPER)
    delete_key(etcd, "/t/cmd")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 5, err
    assert "got SIGTERM" in out
    assert "lost the lock (the key was deleted)" in err
    assert err.count("\n") == 1
