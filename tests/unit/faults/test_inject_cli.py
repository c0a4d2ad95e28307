"""`ftctl inject` as a real process: exit codes, dry runs that change nothing, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.faults.audit import read_audit
from tests.waiting import wait_until


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T for stopped, Z...)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, wanted: set[str], timeout_s: float = 10.0) -> str:
    return wait_until(lambda: _state(pid), timeout_s, f"process {pid} in state {wanted}",
                      accept=lambda state: state in wanted)


@pytest.fixture
def dummy() -> Iterator[subprocess.Popen[bytes]]:
    """A sleeping python child standing in for an engine; always killed at teardown."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def setup(tmp_path: Path, dummy: subprocess.Popen[bytes]) -> dict[str, Path]:
    pid_file = tmp_path / "w1.pid"
    pid_file.write_text(f"{dummy.pid}\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"""
cluster: t
workers:
  - name: w1
    url: http://127.0.0.1:9
    model: m
    process: {{pid_file: w1.pid}}
    faults: [kill, hang, xid63]
    inject: {{injectors: [signal, kmsg], kmsg_path: {tmp_path / 'kmsg.log'}}}
  - name: w2
    url: http://127.0.0.1:9
    model: m
    protected: true
    process: {{pid_file: w1.pid}}
    faults: [kill]
""")
    return {"inv": inv, "audit": tmp_path / "audit.jsonl", "state": tmp_path / "state",
            "kmsg": tmp_path / "kmsg.log"}


def _ftctl(paths: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(paths["inv"]), "inject", *args,
         "--audit-log", str(paths["audit"]), "--state-dir", str(paths["state"])],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )


@pytest.mark.parametrize(("args", "reason"), [
    (["kill", "--worker", "w2", "--yes"], "protected"),
    (["term", "--worker", "w1", "--yes"], "allowlist"),
    (["kill", "--worker", "nope", "--yes"], "no worker named"),
    (["kill", "--worker", "w1"], "--yes"),
])
def test_refusals_exit_2_and_do_nothing(setup: dict[str, Path], dummy: subprocess.Popen[bytes],
                                        args: list[str], reason: str) -> None:
    """Refused targets and faults exit 2 with one error line; the process lives, no audit."""
    done = _ftctl(setup, *args)
    assert done.returncode == 2, done.stderr
    assert reason in done.stderr
    assert done.stdout == ""
    assert dummy.poll() is None
    assert _state(dummy.pid) != "T"
    assert not setup["audit"].exists()


def test_dry_run_changes_nothing(setup: dict[str, Path], dummy: subprocess.Popen[bytes]) -> None:
    """--dry-run prints the exact signal and log line, sends nothing, writes nothing."""
    done = _ftctl(setup, "kill", "--worker", "w1", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"kill -KILL {dummy.pid}" in done.stdout
    done = _ftctl(setup, "xid63", "--worker", "w1", "--dry-run")
    assert f"NVRM: Xid (PCI:0000:3b:00): 63, pid={dummy.pid}, name=python" in done.stdout
    assert dummy.poll() is None
    assert not setup["audit"].exists()
    assert not setup["kmsg"].exists()
    assert not setup["state"].exists()


def test_hang_stops_and_revert_all_continues(setup: dict[str, Path],
                                            dummy: subprocess.Popen[bytes]) -> None:
    """hang SIGSTOPs the engine; `inject revert --all` SIGCONTs it; both are audited."""
    done = _ftctl(setup, "hang", "--worker", "w1", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["pending_revert"]
    assert not doc["reverted"]
    assert _wait_state(dummy.pid, {"T", "t"}) in {"T", "t"}
    done = _ftctl(setup, "revert", "--all")
    assert done.returncode == 0, done.stderr
    assert _wait_state(dummy.pid, {"S", "R"}) in {"S", "R"}
    assert [(a["action"], a["result"]) for a in read_audit(setup["audit"])] == [
        ("inject", "ok"), ("revert", "ok")]


def test_hang_with_duration_reverts_by_itself(setup: dict[str, Path],
                                              dummy: subprocess.Popen[bytes]) -> None:
    """hang --duration 300ms leaves the engine running again when the command returns."""
    done = _ftctl(setup, "hang", "--worker", "w1", "--yes", "--duration", "300ms")
    assert done.returncode == 0, done.stderr
    assert _state(dummy.pid) in {"S", "R"}
    assert [a["action"] for a in read_audit(setup["audit"])] == ["inject", "revert"]
    assert not list((setup["state"] / "reverts").glob("*.json"))


def test_kill_ends_the_process(setup: dict[str, Path], dummy: subprocess.Popen[bytes]) -> None:
    """kill --yes SIGKILLs the pid from the worker's pid file."""
    done = _ftctl(setup, "kill", "--worker", "w1", "--yes")
    assert done.returncode == 0, done.stderr
    assert dummy.wait(timeout=10) == -signal.SIGKILL
    assert read_audit(setup["audit"])[0]["what"] == "kill"


def test_list_prints_json_catalog() -> None:
    """`ftctl inject --list --json` prints the catalog as one JSON document."""
    done = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "inject", "--list", "--json"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    names = [f["name"] for f in json.loads(done.stdout)["faults"]]
    assert "kill" in names
    assert "xid48" in names


def test_netproxy_without_a_control_token_exits_2() -> None:
    """`ftctl inject netproxy` with its token variable unset: one line naming it, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "FTCTL_TEST_NET_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "inject", "netproxy", "--listen", "127.0.0.1:0",
         "--upstream", "127.0.0.1:9", "--token-env", "FTCTL_TEST_NET_TOKEN"],
        capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "$FTCTL_TEST_NET_TOKEN is not set" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""
