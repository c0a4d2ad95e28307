"""`ftctl inject` against real vLLM servers, which have no admin API (no `/admin/fault`).

Every fault goes through the `ftctl inject` CLI, as an operator would run it:

- Signal faults reach the server by pid. vLLM is several processes (API server, engine
  core): a SIGKILL of the API server's pid alone leaves the engine core running with its
  memory (it waits on its ZMQ socket and never learns its parent died), so the inventory
  says `process: {pid, group: true}` and the whole process group is signalled.
- xid48 on a worker without a GPU or an admin API is what ftctl can do honestly: the
  driver's Xid line into the kernel log (a file here) and a SIGKILL, as the fatal Xid
  would end the engine. A contained Xid (94), which fails one request inside the engine,
  is refused: no signal can do that.
- net-* faults go through the TCP fault proxy (`ftctl inject netproxy`) in front of a
  server; each is reverted and the server answers through the proxy again.

A killed server is started again by the `vllm_pair` fixture for the next test; a stopped
one is continued here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.gpu.kmsg import parse_xid_line
from dynamo_ftctl.http1 import HttpError, Reply
from tests import fetch
from tests.cpuquota import group_states
from tests.integration.proxy.test_proxy_sim import ProxyFactory, proxy_factory, wait_until
from tests.integration.vllm.server import VllmServer
from tests.reaper import group_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

__all__ = ["proxy_factory"]

GONE_DEADLINE_S = 60.0  # a SIGTERMed vLLM shuts its engine core down first
# The fault proxy's control token, for `ftctl inject netproxy` and the net injector.
NET_ENV = {**os.environ, "FTCTL_NETPROXY_TOKEN": "net-test-token"}


def write_inventory(tmp_path: Path, server: VllmServer, *, url: str | None = None,
                    injectors: str = "[signal]", netproxy: str | None = None) -> Path:
    """An inventory of one worker: the vLLM server, signalled as a process group."""
    net = f", netproxy: {netproxy}" if netproxy else ""
    path = tmp_path / "inv.yaml"
    path.write_text(f"""
cluster: vllm-faults
workers:
  - name: {server.name}
    url: {url or server.url}
    model: {server.model}
    process: {{pid: {server.proc.pid}, group: true}}
    faults: [kill, term, hang, xid48, xid43, xid94, net-latency, net-reset, net-blackhole]
    inject: {{injectors: {injectors}, kmsg_path: {tmp_path / 'kmsg.log'}{net}}}
""")
    return path


def ftctl(inventory: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `ftctl -i INVENTORY inject ARGS` with its audit log and revert records in tmp."""
    argv = [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "inject", *args]
    if args[0] != "netproxy":
        argv += ["--audit-log", str(tmp_path / "audit.jsonl"),
                 "--state-dir", str(tmp_path / "state")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          env=NET_ENV)


def group_gone(pgid: int) -> bool:
    """True once no process of the group is left."""
    return not group_alive(pgid)



def answers(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET /health answers 200 within `timeout_s`."""
    try:
        return fetch.get(f"{url}/health", timeout=timeout_s).status == 200
    except (HttpError, TimeoutError):
        return False


def complete(url: str, model: str, timeout_s: float = 60.0) -> Reply:
    """One short greedy completion."""
    return fetch.post(f"{url}/v1/completions", timeout=timeout_s, json={
        "model": model, "prompt": "a fault drill", "max_tokens": 8, "temperature": 0.0})


def assert_group_ends(server: VllmServer) -> None:
    """The server's leader exits and every process of its group is gone."""
    wait_until(lambda: server.proc.poll() is not None, GONE_DEADLINE_S, "the API server's exit")
    wait_until(lambda: group_gone(server.proc.pid), GONE_DEADLINE_S,
               "every process of the group (engine core included) to end")


def test_kill_ends_the_whole_server_and_the_proxy_routes_around_it(
    vllm_pair: tuple[VllmServer, ...], proxy_factory: ProxyFactory, tmp_path: Path,
) -> None:
    """kill SIGKILLs the server's process group: no engine core is left behind, /health is
    refused, and the proxy answers every request from the other server."""
    victim = vllm_pair[1]
    assert len(group_states(victim.proc.pid)) >= 2, "vLLM runs an engine core beside its API"
    proxy = factory_over(vllm_pair, proxy_factory)
    inventory = write_inventory(tmp_path, victim)
    done = ftctl(inventory, tmp_path, "kill", "--worker", victim.name, "--yes")
    assert done.returncode == 0, done.stderr
    assert f"kill -KILL -- -{victim.proc.pid}" in done.stdout
    assert_group_ends(victim)
    assert victim.proc.returncode == -signal.SIGKILL
    assert not answers(victim.url)
    for _ in range(4):
        response = complete(proxy, victim.model)
        assert response.status == 200, response.text
        assert response.headers["x-ftctl-worker"].split(",")[-1] == vllm_pair[0].name


def factory_over(pair: tuple[VllmServer, ...], factory: ProxyFactory) -> str:
    """The migrating proxy's URL over the pair."""
    proxy = factory([(s.name, s.url) for s in pair], model=pair[0].model,
                    breaker_threshold=1, stall_timeout_s=5.0)
    return proxy.url


def test_term_shuts_the_server_down(vllm_pair: tuple[VllmServer, ...], tmp_path: Path) -> None:
    """term SIGTERMs the process group: vLLM shuts down and no process of it is left."""
    victim = vllm_pair[1]
    inventory = write_inventory(tmp_path, victim)
    done = ftctl(inventory, tmp_path, "term", "--worker", victim.name, "--yes")
    assert done.returncode == 0, done.stderr
    assert_group_ends(victim)
    assert not answers(victim.url)


def test_hang_stops_every_process_until_reverted(
    vllm_pair: tuple[VllmServer, ...], tmp_path: Path,
) -> None:
    """hang SIGSTOPs the group (every process stopped, /health unanswered); the revert
    SIGCONTs it and the server serves again."""
    victim = vllm_pair[1]
    inventory = write_inventory(tmp_path, victim)
    try:
        done = ftctl(inventory, tmp_path, "hang", "--worker", victim.name, "--yes")
        assert done.returncode == 0, done.stderr
        wait_until(lambda: set(group_states(victim.proc.pid).values()) == {"T"}, 10,
                   "every process of the group to be stopped")
        assert not answers(victim.url, timeout_s=1.0)
        reverted = ftctl(inventory, tmp_path, "revert", "--all")
        assert reverted.returncode == 0, reverted.stderr
        assert f"reverted hang on {victim.name}" in reverted.stdout
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)  # whatever failed, leave it running
    wait_until(lambda: answers(victim.url), 30, "/health 200 after SIGCONT")
    assert complete(victim.url, victim.model).status == 200


def test_xid48_logs_the_line_then_kills_the_server(
    vllm_pair: tuple[VllmServer, ...], tmp_path: Path,
) -> None:
    """xid48 without an admin API: the driver's Xid line (naming the server's pid) into the
    kernel log, then SIGKILL of the group, as a fatal Xid ends the engine."""
    victim = vllm_pair[1]
    inventory = write_inventory(tmp_path, victim, injectors="[signal, kmsg]")
    done = ftctl(inventory, tmp_path, "xid48", "--worker", victim.name, "--yes")
    assert done.returncode == 0, done.stderr
    assert_group_ends(victim)
    lines = (tmp_path / "kmsg.log").read_text().splitlines()
    assert len(lines) == 1
    parsed = parse_xid_line(lines[0])
    assert parsed is not None
    assert (parsed.xid, parsed.pid) == (48, victim.proc.pid)


@pytest.mark.parametrize(("fault", "injectors", "says"), [
    ("xid48", "[signal]", "allow kmsg"),
    ("xid94", "[signal, kmsg]", "only the engine's admin API"),
], ids=["xid48-without-a-log", "xid94-contained"])
def test_xid_faults_a_server_cannot_show_are_refused(
    vllm_pair: tuple[VllmServer, ...], tmp_path: Path, fault: str, injectors: str, says: str,
) -> None:
    """An Xid ftctl cannot make honest on vLLM is one line, exit 2, and the server untouched."""
    victim = vllm_pair[1]
    inventory = write_inventory(tmp_path, victim, injectors=injectors)
    done = ftctl(inventory, tmp_path, fault, "--worker", victim.name, "--yes")
    assert done.returncode == 2
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert victim.alive
    assert answers(victim.url)


@pytest.fixture
def netproxy(vllm_pair: tuple[VllmServer, ...]) -> Iterator[dict[str, str]]:
    """`ftctl inject netproxy` in front of the second server: its listen and control URLs."""
    upstream = vllm_pair[1].url.removeprefix("http://")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_ftctl", "inject", "netproxy", "--listen", "127.0.0.1:0",
         "--upstream", upstream], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=NET_ENV)
    assert proc.stdout is not None
    with proc.stdout:
        try:
            info = json.loads(proc.stdout.readline())
            yield {"url": f"http://{info['listen']}", "control": info["control"]}
        finally:
            proc.terminate()
            proc.wait(10)


def timed(call: Callable[[], object]) -> float:
    """Seconds `call` took."""
    began = time.monotonic()
    call()
    return time.monotonic() - began


def test_net_faults_through_the_fault_proxy_and_their_reverts(
    vllm_pair: tuple[VllmServer, ...], netproxy: dict[str, str], tmp_path: Path,
) -> None:
    """net-latency delays answers through the fault proxy, net-reset resets them,
    net-blackhole leaves them unanswered; after each revert the server answers again."""
    server = vllm_pair[1]
    inventory = write_inventory(tmp_path, server, url=netproxy["url"],
                                injectors="[signal, net]", netproxy=netproxy["control"])
    via = netproxy["url"]
    assert complete(via, server.model).status == 200

    def inject(*args: str) -> None:
        done = ftctl(inventory, tmp_path, *args, "--worker", server.name, "--yes")
        assert done.returncode == 0, done.stderr

    def revert() -> None:
        done = ftctl(inventory, tmp_path, "revert", "--all")
        assert done.returncode == 0, done.stderr
        toxics = fetch.get(f"{netproxy['control']}/toxics", timeout=5).json()
        assert toxics == {"toxics": []}, toxics

    inject("net-latency", "--delay-ms", "300")
    assert timed(lambda: complete(via, server.model)) >= 0.3
    revert()
    assert timed(lambda: fetch.get(f"{via}/health", timeout=5)) < 0.3

    inject("net-reset")
    with pytest.raises((HttpError, TimeoutError)):
        complete(via, server.model, timeout_s=10)
    assert answers(server.url), "a reset in front of the server leaves the server alone"
    revert()
    assert complete(via, server.model).status == 200

    inject("net-blackhole")
    with pytest.raises(TimeoutError):
        complete(via, server.model, timeout_s=2)
    assert answers(server.url)
    revert()
    assert complete(via, server.model).status == 200
