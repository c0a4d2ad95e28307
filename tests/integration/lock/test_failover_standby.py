"""`ftctl failover run --standby`: cold shadows, and engines that refuse /sleep (real processes)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from dynamo_ftctl.http1 import NoConnection
from tests import fetch
from tests.integration.lock import test_failover
from tests.integration.lock.test_failover import (
    Wrapper,
    WrapperFactory,
    exists,
    fake_engine,
    free_port,
    stderr_of,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

start_wrapper = test_failover.start_wrapper  # the fixture: wrappers on tmp_path/failover.lock


def sleepless_engine(port: int, root: Path) -> list[str]:
    """An engine without sleep mode: /health 200 (a file), POST /sleep 501 (http.server)."""
    root.mkdir(exist_ok=True)
    (root / "health").write_text("ok")
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
            "--directory", str(root)]


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Process `pid` gone within `timeout` s (True), or AssertionError naming it."""
    return wait_until(lambda: not exists(pid), timeout, f"process {pid} gone")


def kill_wrapper(wrapper: Wrapper) -> None:
    """SIGKILL the wrapper (its engine dies with it: PDEATHSIG)."""
    wrapper.proc.kill()
    wrapper.proc.wait(10)


def test_cold_shadow_starts_its_engine_only_with_the_lock(start_wrapper: WrapperFactory) -> None:
    """A cold shadow runs no engine in STANDBY (200); the primary's death starts it, with a higher token."""
    p_port, s_port = free_port(), free_port()
    primary = start_wrapper(0, fake_engine(p_port), f"http://127.0.0.1:{p_port}",
                            "--standby", "cold")
    active = primary.wait_state("ACTIVE")
    assert active["token"] > 0
    assert active["engine_pid"] is not None
    shadow = start_wrapper(1, fake_engine(s_port), f"http://127.0.0.1:{s_port}",
                           "--standby", "cold")
    standby = shadow.wait_state("STANDBY")
    assert standby["engine_pid"] is None
    assert standby["standby"] == "cold"
    assert shadow.health().status == 200
    with pytest.raises(NoConnection):
        fetch.get(f"{shadow.engine_url}/health", timeout=5)

    kill_wrapper(primary)
    assert gone(active["engine_pid"])
    waking = shadow.wait_state("WAKING", timeout=30)
    assert waking["token"] > active["token"]
    assert waking["engine_pid"] is not None
    taken = shadow.wait_state("ACTIVE", timeout=30)
    assert taken["token"] > active["token"]
    assert fetch.post(f"{shadow.engine_url}/v1/completions", timeout=5).status == 200


def test_auto_without_sleep_mode_serves_or_waits_cold(
    start_wrapper: WrapperFactory, tmp_path: Path,
) -> None:
    """Auto: an engine refusing /sleep serves if the lock is free, else is stopped (cold)."""
    p_port, s_port = free_port(), free_port()
    primary = start_wrapper(0, sleepless_engine(p_port, tmp_path / "p"),
                            f"http://127.0.0.1:{p_port}")
    active = primary.wait_state("ACTIVE")
    assert active["token"] > 0
    assert "no sleep mode" in active["detail"]
    assert "HTTP 501" in active["detail"]
    shadow = start_wrapper(1, sleepless_engine(s_port, tmp_path / "s"),
                           f"http://127.0.0.1:{s_port}")
    init = shadow.wait_state("INIT")
    standby = shadow.wait_state("STANDBY")
    assert standby["standby"] == "cold"
    assert "no sleep mode" in standby["detail"]
    assert standby["engine_pid"] is None
    assert gone(init["engine_pid"])

    kill_wrapper(primary)
    taken = shadow.wait_state("ACTIVE", timeout=30)
    assert taken["token"] > active["token"]
    assert fetch.get(f"{shadow.engine_url}/health", timeout=5).status == 200


def test_standby_sleep_with_an_engine_refusing_sleep_exits_2(
    start_wrapper: WrapperFactory, tmp_path: Path,
) -> None:
    """--standby sleep and an engine without sleep mode: one line with a hint, exit 2."""
    port = free_port()
    wrapper = start_wrapper(0, sleepless_engine(port, tmp_path / "e"),
                            f"http://127.0.0.1:{port}", "--standby", "sleep")
    init = wrapper.wait_state("INIT")
    assert wrapper.proc.wait(30) == 2
    errors = [line for line in stderr_of(wrapper).splitlines() if "no sleep mode" in line]
    assert len(errors) == 1
    assert "--standby cold" in errors[0]
    assert gone(init["engine_pid"])


def test_engine_refusing_enable_sleep_mode_at_start_gets_a_hint(
    start_wrapper: WrapperFactory,
) -> None:
    """An engine that exits in INIT with --enable-sleep-mode in its argv: exit 1 and a hint."""
    engine = [sys.executable, "-c", "raise SystemExit(1)", "--enable-sleep-mode"]
    wrapper = start_wrapper(0, engine, f"http://127.0.0.1:{free_port()}")
    assert wrapper.proc.wait(30) == 1
    err = stderr_of(wrapper)
    assert "exited with code 1 in state INIT" in err
    assert "drop --enable-sleep-mode and use --standby cold" in err


def test_unknown_standby_mode_exits_2(start_wrapper: WrapperFactory) -> None:
    """--standby with an unknown mode is a one-line usage error, exit 2, no engine started."""
    wrapper = start_wrapper(0, fake_engine(free_port()), "http://127.0.0.1:1",
                            "--standby", "warm")
    assert wrapper.proc.wait(30) == 2
    assert "--standby must be one of auto, sleep, cold (got 'warm')" in stderr_of(wrapper)


def test_sigterm_in_cold_standby_exits_0(start_wrapper: WrapperFactory, tmp_path: Path) -> None:
    """SIGTERM while a cold shadow waits for the lock exits 0 without starting the engine."""
    holder = start_wrapper(0, fake_engine(free_port()), "http://127.0.0.1:1", "--standby", "cold")
    # The lock held by a first wrapper: its engine never gets healthy, so it stays in WAKING.
    holder.wait_state("WAKING")
    shadow = start_wrapper(1, fake_engine(free_port()), "http://127.0.0.1:1", "--standby", "cold")
    shadow.wait_state("STANDBY")
    shadow.proc.send_signal(signal.SIGTERM)
    assert shadow.proc.wait(30) == 0
    stopped = shadow.wait_state("STOPPED")
    assert stopped["detail"] == "no engine running (cold standby)"
    assert tmp_path.joinpath("failover.lock").exists()
