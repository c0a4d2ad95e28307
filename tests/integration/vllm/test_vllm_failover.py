"""`ftctl failover run` in front of real vLLM (CPU): a cold shadow takes over from a killed primary.

vLLM on CPU has no sleep mode (it refuses `--enable-sleep-mode` at start-up, and without
`VLLM_SERVER_DEV_MODE=1` it has no /sleep route), so the shadow runs `--standby auto`: its
vLLM starts, refuses /sleep, is stopped, and the wrapper waits cold. Killing the primary's
process group hands the lock over; the shadow starts vLLM cold and serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.http1 import NoConnection, Reply
from tests import fetch
from tests.integration.lock.test_failover import Wrapper, free_port
from tests.integration.vllm.server import SERVED_NAME, START_DEADLINE_S
from tests.reaper import forget, group_alive, popen_group
from tests.waiting import wait_until

StartWrapper = Callable[..., Wrapper]


def vllm_command(python: Path, model: Path, port: int) -> list[str]:
    """The vLLM OpenAI server on 127.0.0.1:`port` (what a pod would run)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_NAME, "--dtype", "float32", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port)]


def group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of group `pgid` is gone within `timeout` s."""

    try:
        return wait_until(lambda: not group_alive(pgid), timeout, f"every process of group {pgid} gone", interval=0.05)
    except AssertionError:
        return False


@pytest.fixture
def start_wrapper(tmp_path: Path) -> Iterator[StartWrapper]:
    """`failover run` processes on tmp_path/failover.lock, each in its own process group;
    every group is killed (SIGTERM, SIGKILL after a deadline) at teardown."""
    started: list[Wrapper] = []
    cpus = sorted(os.sched_getaffinity(0))

    def start(engine_id: int, engine: list[str], engine_url: str, *extra: str) -> Wrapper:
        port = free_port()
        env = {**os.environ, "NO_COLOR": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the smallest nonzero
               "VLLM_CPU_OMP_THREADS_BIND": str(cpus[engine_id % len(cpus)]),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("VLLM_SERVER_DEV_MODE", None)
        log = (tmp_path / f"wrapper{engine_id}.log").open("w")
        proc = popen_group(
            [sys.executable, "-m", "dynamo_ftctl", "failover", "run", "--json",
             "--engine-id", str(engine_id), "--health-port", str(port),
             "--path", str(tmp_path / "failover.lock"), "--engine-url", engine_url,
             "--ready-timeout", str(START_DEADLINE_S), *extra, "--", *engine],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()
        wrapper = Wrapper(proc, port, engine_url)

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                wrapper.lines.put(json.loads(raw))

        threading.Thread(target=pump, daemon=True).start()
        started.append(wrapper)
        return wrapper

    try:
        yield start
    finally:
        for wrapper in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(wrapper.proc.pid, signal.SIGTERM)
        for wrapper in started:
            try:
                wrapper.proc.wait(30)  # reaped: a zombie leader would keep the group "alive"
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(wrapper.proc.pid, signal.SIGKILL)
                wrapper.proc.wait(30)
            if not group_gone(wrapper.proc.pid, 30):  # vLLM's engine core, orphaned
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(wrapper.proc.pid, signal.SIGKILL)
            assert group_gone(wrapper.proc.pid, 30), f"group {wrapper.proc.pid} outlived the test"
            forget(wrapper.proc.pid)
            if wrapper.proc.stdout is not None:
                wrapper.proc.stdout.close()


def complete(url: str) -> Reply:
    """One short completion (a fresh server's first request takes 6-10 s)."""
    body = {"model": SERVED_NAME, "prompt": "the lock moves", "max_tokens": 4}
    return fetch.post(f"{url}/v1/completions", json=body, timeout=120)


def test_cold_shadow_takes_over_from_a_killed_vllm_primary(
    start_wrapper: StartWrapper, vllm_py: Path, tiny_llama: Path,
) -> None:
    """Primary killed (its process group): the cold shadow starts vLLM and serves, with a higher token."""
    p_port, s_port = free_port(), free_port()
    primary = start_wrapper(0, vllm_command(vllm_py, tiny_llama, p_port),
                            f"http://127.0.0.1:{p_port}", "--standby", "cold")
    first = primary.wait_state("ACTIVE", timeout=START_DEADLINE_S)
    assert first["token"] > 0
    assert complete(primary.engine_url).status == 200

    # auto: this vLLM starts warm, refuses /sleep (no sleep mode on CPU), and is stopped.
    shadow = start_wrapper(1, vllm_command(vllm_py, tiny_llama, s_port),
                           f"http://127.0.0.1:{s_port}")
    standby = shadow.wait_state("STANDBY", timeout=START_DEADLINE_S)
    assert standby["standby"] == "cold"
    assert "engine has no sleep mode" in standby["detail"]
    assert standby["engine_pid"] is None
    with pytest.raises(NoConnection):
        fetch.get(f"{shadow.engine_url}/health", timeout=5)
    assert shadow.health().status == 200

    os.killpg(primary.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert primary.proc.wait(30) == -signal.SIGKILL
    assert group_gone(primary.proc.pid, 30)
    taken = shadow.wait_state("ACTIVE", timeout=START_DEADLINE_S)
    took = time.monotonic() - killed
    assert taken["token"] > first["token"]
    assert fetch.get(f"{shadow.engine_url}/health", timeout=5).status == 200
    served = complete(shadow.engine_url)
    assert served.status == 200, served.text
    assert served.json()["choices"][0]["text"]
    print(f"cold takeover: ACTIVE {took:.1f} s after the primary's group was killed")
