"""`ftctl failover run` with real engine processes on loopback: states, handover, failures."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.http1 import NoConnection, Reply
from tests import fetch
from tests.reaper import process_exists
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


exists = process_exists  # the name these tests and test_failover_standby's use
@dataclass
class Wrapper:
    """One `ftctl failover run` process and the state lines it printed."""

    proc: subprocess.Popen[str]
    health_port: int
    engine_url: str
    lines: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def wait_state(self, state: str, timeout: float = 60.0) -> dict[str, Any]:
        """The first state line with `state`, waiting at most `timeout` s."""
        for line in self.seen:
            if line["state"] == state:
                return line

        def states() -> list[str]:
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=0.1))
            return [line["state"] for line in self.seen]

        wait_until(states, timeout, f"state {state}", accept=lambda seen: state in seen[-1:],
                   interval=0)
        return self.seen[-1]

    def health(self) -> Reply:
        return fetch.get(f"http://127.0.0.1:{self.health_port}/health", timeout=5)


WrapperFactory = Callable[..., Wrapper]


@pytest.fixture
def start_wrapper(tmp_path: Path) -> Iterator[WrapperFactory]:
    """Start `failover run` processes sharing tmp_path/failover.lock; all killed at teardown."""
    started: list[Wrapper] = []

    def start(engine_id: int, engine: list[str], engine_url: str, *extra: str,
              env: dict[str, str] | None = None) -> Wrapper:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", "failover", "run", "--json",
             "--engine-id", str(engine_id), "--health-port", str(port),
             "--path", str(tmp_path / "failover.lock"), "--engine-url", engine_url, *extra,
             "--", *engine],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "NO_COLOR": "1", **(env or {})},
        )
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
            if wrapper.proc.poll() is None:
                wrapper.proc.kill()
            wrapper.proc.wait(10)
            for stream in (wrapper.proc.stdout, wrapper.proc.stderr):
                if stream is not None:
                    stream.close()


def fake_engine(port: int, *args: str) -> list[str]:
    return [sys.executable, str(FAKE_ENGINE), str(port), *args]


def stderr_of(wrapper: Wrapper) -> str:
    assert wrapper.proc.stderr is not None
    return wrapper.proc.stderr.read()


def test_primary_active_shadow_standby_then_handover(start_wrapper: WrapperFactory) -> None:
    """Primary goes ACTIVE, shadow sleeps in STANDBY (200); killing the primary engine hands over."""
    p_port, s_port = free_port(), free_port()
    primary = start_wrapper(0, fake_engine(p_port), f"http://127.0.0.1:{p_port}")
    active = primary.wait_state("ACTIVE")
    assert active["token"] > 0
    shadow = start_wrapper(1, fake_engine(s_port), f"http://127.0.0.1:{s_port}")
    shadow.wait_state("STANDBY")
    response = shadow.health()
    assert response.status == 200
    assert response.json()["state"] == "STANDBY"
    active_url = "http://127.0.0.1:{}/active"
    assert fetch.get(active_url.format(shadow.health_port), timeout=5).status == 503
    assert fetch.get(active_url.format(primary.health_port), timeout=5).status == 200
    assert fetch.post(f"{shadow.engine_url}/v1/completions", timeout=5).status == 503

    os.kill(active["engine_pid"], signal.SIGKILL)
    assert primary.proc.wait(30) == 1
    assert "exited with code -9" in stderr_of(primary)
    taken = shadow.wait_state("ACTIVE", timeout=30)
    assert taken["token"] > active["token"]
    assert shadow.health().json()["state"] == "ACTIVE"
    assert fetch.post(f"{shadow.engine_url}/v1/completions", timeout=5).status == 200
    metrics = fetch.get(f"http://127.0.0.1:{shadow.health_port}/metrics", timeout=5).text
    assert 'ftctl_lock_holder{engine_id="1"' in metrics
    assert "ftctl_lock_acquire_seconds_count 1.0" in metrics


@pytest.mark.parametrize("token", ["s3cret", None])
def test_sleep_and_wake_carry_the_engines_admin_token(start_wrapper: WrapperFactory,
                                                      token: str | None) -> None:
    """/sleep and /wake_up carry Bearer $FTCTL_ADMIN_TOKEN; unset, the wrapper makes one and
    hands it to its engine, so an engine that requires it still sleeps and wakes."""
    port = free_port()
    env = {"FTCTL_ADMIN_TOKEN": token or ""}
    wrapper = start_wrapper(0, fake_engine(port, "--token-env", "FTCTL_ADMIN_TOKEN"),
                            f"http://127.0.0.1:{port}", "--standby", "sleep", env=env)
    assert wrapper.wait_state("STANDBY")["standby"] == "sleep"
    wrapper.wait_state("ACTIVE")
    assert fetch.post(f"{wrapper.engine_url}/v1/completions", timeout=5).status == 200


def test_an_engine_checking_another_token_is_named(start_wrapper: WrapperFactory) -> None:
    """An engine reading another variable refuses /sleep (403): --standby sleep exits 2 and
    points at --admin-token-env instead of blaming a missing sleep mode."""
    port = free_port()
    wrapper = start_wrapper(0, fake_engine(port, "--token-env", "OTHER_TOKEN"),
                            f"http://127.0.0.1:{port}", "--standby", "sleep",
                            env={"OTHER_TOKEN": ""})
    assert wrapper.proc.wait(30) == 2
    err = stderr_of(wrapper)
    assert "refused /sleep" in err
    assert "--admin-token-env" in err


def test_init_answers_503_and_engine_death_exits_non_zero(start_wrapper: WrapperFactory) -> None:
    """An engine that never gets healthy keeps the wrapper in INIT (503); its death exits 1."""
    engine = [sys.executable, "-c", "import time; time.sleep(120)"]
    wrapper = start_wrapper(0, engine, f"http://127.0.0.1:{free_port()}")
    init = wrapper.wait_state("INIT")
    response = wait_until(wrapper.health, 30, "the wrapper's health server",  # it starts
                          ignore=(NoConnection,))  # right after the engine
    assert response.status == 503
    assert response.json()["state"] == "INIT"
    os.kill(init["engine_pid"], signal.SIGKILL)
    assert wrapper.proc.wait(30) == 1


def test_wake_timeout_exits_1_with_a_clear_error(start_wrapper: WrapperFactory) -> None:
    """An engine slower to wake than --wake-timeout makes the wrapper exit 1 and say so."""
    port = free_port()
    wrapper = start_wrapper(0, fake_engine(port, "--wake-delay", "5"),
                            f"http://127.0.0.1:{port}", "--wake-timeout", "0.3")
    wrapper.wait_state("WAKING")
    assert wrapper.proc.wait(30) == 1
    assert "did not wake within 0.3 s" in stderr_of(wrapper)


def test_sigterm_stops_engine_and_frees_the_lock(
    start_wrapper: WrapperFactory, tmp_path: Path,
) -> None:
    """SIGTERM stops the engine, releases the lock and exits 0."""
    port = free_port()
    wrapper = start_wrapper(0, fake_engine(port, "--no-is-sleeping"), f"http://127.0.0.1:{port}")
    active = wrapper.wait_state("ACTIVE")
    wrapper.proc.send_signal(signal.SIGTERM)
    assert wrapper.proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(active["engine_pid"], 0)
    status = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "lock", "status", "-p",
         str(tmp_path / "failover.lock")], capture_output=True, text=True, timeout=60, check=False,
    )
    assert status.returncode == 1


def test_deleted_lock_file_stops_the_engine_and_exits_5(
    start_wrapper: WrapperFactory, tmp_path: Path,
) -> None:
    """The lock file deleted under an ACTIVE wrapper: it stops its engine and exits 5 with one
    line saying the lock was lost (another engine may hold it now)."""
    port = free_port()
    wrapper = start_wrapper(0, fake_engine(port, "--no-is-sleeping"), f"http://127.0.0.1:{port}")
    active = wrapper.wait_state("ACTIVE")
    (tmp_path / "failover.lock").unlink()
    assert wrapper.proc.wait(30) == 5
    assert "the lock file was deleted" in stderr_of(wrapper)
    with pytest.raises(ProcessLookupError):
        os.kill(active["engine_pid"], 0)


def test_wrapper_killed_takes_its_engine_with_it(start_wrapper: WrapperFactory) -> None:
    """SIGKILL of the wrapper kills the engine too (no engine serves without the lock)."""
    port = free_port()
    wrapper = start_wrapper(0, fake_engine(port), f"http://127.0.0.1:{port}")
    active = wrapper.wait_state("ACTIVE")
    wrapper.proc.kill()
    wrapper.proc.wait(10)
    wait_until(lambda: not exists(active["engine_pid"]), 10, "the engine gone with its wrapper")


@pytest.mark.slow
def test_two_sim_engines_shadow_takes_over_and_serves(start_wrapper: WrapperFactory) -> None:
    """With two `ftctl sim` engines, killing the active one makes the shadow ACTIVE and serving."""
    ports = free_port(), free_port()

    def start(i: int) -> Wrapper:
        engine = [sys.executable, "-m", "dynamo_ftctl", "sim", "serve", "--port", str(ports[i])]
        return start_wrapper(i, engine, f"http://127.0.0.1:{ports[i]}")

    primary = start(0)
    first = primary.wait_state("ACTIVE", timeout=120)  # before the shadow starts: no race
    wrappers = [primary, start(1)]
    # Asleep, not cold: the sim takes the token the wrapper made for it on /sleep.
    assert wrappers[1].wait_state("STANDBY", timeout=120)["standby"] == "sleep"
    body = {"model": "ftctl-sim-tiny", "prompt": "hello", "max_tokens": 4}
    served = fetch.post(f"{wrappers[0].engine_url}/v1/completions", json=body, timeout=30)
    assert served.status == 200, served.text
    asleep = fetch.post(f"{wrappers[1].engine_url}/v1/completions", json=body, timeout=30)
    assert asleep.status == 503

    os.kill(first["engine_pid"], signal.SIGKILL)
    assert wrappers[0].proc.wait(30) == 1
    wrappers[1].wait_state("ACTIVE", timeout=60)
    response = fetch.post(f"{wrappers[1].engine_url}/v1/completions", json=body, timeout=30)
    assert response.status == 200, response.text
    assert response.json()["choices"][0]["text"]
