"""`ftctl lock`: exec and --fd forms, exit codes 0/1/2/4, start-up weight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interrupt import sigint_deliverable
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("httpx", "torch", "aiohttp", "uvicorn", "starlette", "pydantic", "prometheus_client")


def ftctl(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", *args], capture_output=True, text=True,
        timeout=60, input=stdin, env={**os.environ, "NO_COLOR": "1", **(env or {})},
        check=False, cwd=ROOT,
    )


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


def test_neither_command_nor_fd_explains_both_forms(lock_path: Path) -> None:
    """`lock acquire` alone exits 2 with one line naming both forms."""
    proc = ftctl("lock", "acquire", "--path", str(lock_path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "-- CMD" in proc.stderr
    assert "--fd 9" in proc.stderr


def test_exec_form_keeps_the_lock_until_the_command_exits(lock_path: Path) -> None:
    """The command runs holding the lock (same pid, token in env); the lock frees when it exits."""
    script = (
        "import os, subprocess, sys\n"
        "status = subprocess.run([sys.executable, '-m', 'dynamo_ftctl', 'lock', 'status', "
        "'--json', '--path', sys.argv[1]], capture_output=True, text=True)\n"
        "print(status.returncode, os.getpid(), os.environ['FTCTL_LOCK_TOKEN'], status.stdout)\n"
    )
    proc = ftctl("lock", "acquire", "--path", str(lock_path), "--engine-id", "5", "--",
                 sys.executable, "-c", script, str(lock_path))
    assert proc.returncode == 0, proc.stderr
    code, pid, token, doc = proc.stdout.split(" ", 3)
    owner = json.loads(doc)["owner"]
    assert code == "0"  # held while the command runs
    assert owner["pid"] == int(pid)  # exec: the command is the holder
    assert owner["engine_id"] == 5
    assert int(token) > 0
    after = ftctl("lock", "status", "--path", str(lock_path))
    assert after.returncode == 1
    assert "stale" in after.stdout


def test_exec_form_passes_the_exit_code_through(lock_path: Path) -> None:
    """exec means the command's exit code is ftctl's exit code."""
    assert ftctl("lock", "acquire", "-p", str(lock_path), "--", "sh", "-c", "exit 7").returncode == 7


def test_timeout_exits_4_while_another_process_holds(lock_path: Path) -> None:
    """A held lock and --timeout give exit 4 and a line naming the holder."""
    script = (
        f"{sys.executable} -m dynamo_ftctl lock acquire -p {lock_path} -t 0.2 -- true; "
        "echo rc=$?"
    )
    proc = ftctl("lock", "acquire", "-p", str(lock_path), "--engine-id", "0", "--",
                 "sh", "-c", script)
    assert "rc=4" in proc.stdout
    assert "held by engine 0" in proc.stderr


def test_fd_form_locks_the_shell_descriptor_until_release(lock_path: Path) -> None:
    """`exec 9<>P; lock acquire --fd 9` holds the lock for the shell; `release --fd 9` frees it."""
    ft = f"{sys.executable} -m dynamo_ftctl"
    script = (
        f"exec 9<>{lock_path}\n"
        f"{ft} lock acquire --fd 9 --engine-id 2 --json || exit 10\n"
        f"{ft} lock status -p {lock_path}; echo held=$?\n"
        f"{ft} lock acquire -p {lock_path} -t 0 -- true; echo other=$?\n"
        f"{ft} lock release --fd 9\n"
        f"{ft} lock status -p {lock_path}; echo after=$?\n"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lease = json.loads(proc.stdout[: proc.stdout.index("}") + 1])
    assert lease["token"] > 0
    assert lease["engine_id"] == 2
    assert "held=0" in proc.stdout
    assert "other=4" in proc.stdout
    assert "after=1" in proc.stdout


def test_fd_form_with_a_write_only_descriptor(lock_path: Path) -> None:
    """`exec 9>P` (write-only) still locks and records owner data."""
    script = (f"exec 9>{lock_path}\n{sys.executable} -m dynamo_ftctl lock acquire --fd 9 "
              f"--engine-id 4 && {sys.executable} -m dynamo_ftctl lock owner --json -p {lock_path}")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert '"engine_id": 4' in proc.stdout


def test_status_of_a_fresh_path_is_free(lock_path: Path) -> None:
    """A lock that was never taken is free: exit 1."""
    proc = ftctl("lock", "owner", "--path", str(lock_path), "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["held"] is False


def test_path_and_engine_id_from_environment(lock_path: Path) -> None:
    """$FAILOVER_LOCK_PATH and $ENGINE_ID are the defaults of --path and --engine-id."""
    env = {"FAILOVER_LOCK_PATH": str(lock_path), "ENGINE_ID": "9"}
    assert ftctl("lock", "acquire", "--", "true", env=env).returncode == 0
    doc = json.loads(ftctl("lock", "owner", "--json", env=env).stdout)
    assert doc["owner"]["engine_id"] == 9


def test_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    """No --path, no $FAILOVER_LOCK_PATH, no inventory: exit 2 naming all three."""
    env = {k: v for k, v in os.environ.items() if k not in ("FAILOVER_LOCK_PATH", "FTCTL_INVENTORY")}
    proc = subprocess.run([sys.executable, "-m", "dynamo_ftctl", "lock", "status"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
                          check=False)
    assert proc.returncode == 2
    assert "--path" in proc.stderr
    assert "FAILOVER_LOCK_PATH" in proc.stderr


def test_path_from_the_inventory(tmp_path: Path) -> None:
    """Without flag or variable, lock.path comes from the inventory."""
    inventory = tmp_path / "ftctl.yaml"
    lock_file = tmp_path / "inv.lock"
    inventory.write_text(
        "cluster: t\nworkers:\n  - {name: w1, url: 'http://127.0.0.1:1', model: m}\n"
        f"lock: {{path: {lock_file}}}\n",
    )
    env = {k: v for k, v in os.environ.items() if k != "FAILOVER_LOCK_PATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "lock", "acquire", "--",
         "true"], capture_output=True, text=True, timeout=60, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(lock_file.read_text())["token"] > 0


def test_lock_status_imports_nothing_heavy(lock_path: Path) -> None:
    """`ftctl lock status --path P` loads neither httpx, pydantic nor prometheus_client."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dynamo_ftctl", "lock", "status", "-p",
         str(lock_path)], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )
    loaded = {line.rsplit("|", 1)[1].strip().split(".")[0]
              for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_ctrl_c_while_waiting_exits_130_with_one_line(lock_path: Path) -> None:
    """Ctrl-C (SIGINT) while `lock acquire` waits on a held lock: exit 130 and "interrupted"."""
    import fcntl
    import signal

    with lock_path.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an open file description of ours holds it
        with sigint_deliverable():
            proc = subprocess.Popen(
                [sys.executable, "-m", "dynamo_ftctl", "lock", "acquire", "--path",
                 str(lock_path), "--", "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, cwd=ROOT)
        try:
            inode = lock_path.stat().st_ino

            def queued() -> bool:
                assert proc.poll() is None, proc.communicate()
                return any("->" in line and f":{inode} " in line
                           for line in Path("/proc/locks").read_text().splitlines())

            wait_until(queued, 30, "ftctl blocked in flock (/proc/locks)")
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130
    assert err == "interrupted\n"
