"""A lock file deleted or replaced under its holder: the holder is told (issue 22, finding 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_ftctl.errors import LeaseLost
from dynamo_ftctl.lock import FlockLock
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
FTCTL = (sys.executable, "-m", "dynamo_ftctl")

# The held command: says it runs (with its token), answers SIGTERM with a line (and when it
# came, on the system-wide monotonic clock) and exit 7.
TRAPPER = """
import os, signal, sys, time
def bye(signum, _frame):
    print("got", signal.Signals(signum).name, time.monotonic(), flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, bye)
print("ready", os.environ["FTCTL_LOCK_TOKEN"], flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(9)
"""
# A command that ignores SIGTERM and names its children (pgrep leaves itself out): the
# watcher, forked before the exec, is the only one.
STUBBORN = """
import os, signal, subprocess, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
kids = subprocess.run(["pgrep", "-P", str(os.getpid())],
                      capture_output=True, text=True).stdout.split()
print("ready", os.environ["FTCTL_LOCK_TOKEN"], " ".join(kids), flush=True)
time.sleep(60)
"""


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; killed at teardown whatever happened."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def hold(procs: list[subprocess.Popen[str]], *argv: str,
         env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `argv`; its first stdout line, split, once the held command printed it."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    procs.append(proc)
    assert proc.stdout is not None
    first = proc.stdout.readline().split()
    assert first, proc.communicate(timeout=10)
    assert first[0] == "ready", first
    return proc, first


def token_of_next_acquirer(lock_path: Path) -> int:
    """The token a new `ftctl lock acquire -- CMD` gets (CMD prints it)."""
    proc = subprocess.run([*FTCTL, "lock", "acquire", "-p", str(lock_path), "-t", "10", "--",
                           "sh", "-c", "echo $FTCTL_LOCK_TOKEN"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_command_gets_sigterm_when_its_lock_file_goes(
    lock_path: Path, procs: list[subprocess.Popen[str]], how: str,
) -> None:
    """Lock file deleted or replaced under `acquire -- CMD`: CMD gets SIGTERM within a few
    checks (default 0.5 s), one line says why, and the next holder's token is higher."""
    holder, (_, token) = hold(procs, *FTCTL, "lock", "acquire", "-p", str(lock_path), "--",
                              sys.executable, "-c", TRAPPER)
    gone_at = time.monotonic()
    if how == "deleted":
        lock_path.unlink()
    else:
        (lock_path.parent / "other").write_text("")
        (lock_path.parent / "other").rename(lock_path)
    assert token_of_next_acquirer(lock_path) > int(token)  # fencing: the new holder wins
    out, err = holder.communicate(timeout=30)
    assert holder.returncode == 7, err  # the command's own status (it is the exec'd holder)
    assert "got SIGTERM" in out
    # Deleted, then re-created by the next acquirer before the check: "replaced" is right too.
    said = {f"{lock_path} was {how}", f"{lock_path} was replaced by another file"}
    assert any(line in err for line in said), err
    assert "sending SIGTERM" in err
    signalled_after = float(out.split("got SIGTERM")[1].split()[0]) - gone_at
    assert signalled_after < 5, signalled_after  # 0.5 s checks, on a loaded 2-core machine


def test_stubborn_command_is_killed_after_the_grace_period(
    lock_path: Path, procs: list[subprocess.Popen[str]],
) -> None:
    """A command that ignores SIGTERM gets SIGKILL once the grace period is over."""
    script = (
        "import sys\n"
        "from dynamo_ftctl.lock import FlockLock\n"
        "from dynamo_ftctl.lock.holder import exec_holding\n"
        "exec_holding(FlockLock(sys.argv[1], watch_interval_s=0), sys.argv[2:],"
        " watch_interval_s=0.05, term_grace_s=0.5)\n"
    )
    holder, _ = hold(procs, sys.executable, "-c", script, str(lock_path), sys.executable, "-c",
                     STUBBORN)
    lock_path.unlink()
    _, err = holder.communicate(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    assert "sending SIGTERM" in err
    assert "still running 0.5 s after SIGTERM: sending SIGKILL" in err


def test_watcher_holds_no_lock_and_exits_with_the_command(
    lock_path: Path, procs: list[subprocess.Popen[str]],
) -> None:
    """The watcher process keeps no descriptor of the lock file and is gone once CMD is."""
    holder, ready = hold(procs, *FTCTL, "lock", "acquire", "-p", str(lock_path), "--",
                         sys.executable, "-c", STUBBORN)
    assert len(ready) == 3, ready  # one watcher
    watcher = int(ready[2])
    wait_until(lambda: Path(f"/proc/{watcher}/comm").read_text().strip(), 10,  # it names
               "the watcher's name", accept=lambda name: name == "ftctl-lockwatch")  # itself
    fds = Path(f"/proc/{watcher}/fd")
    assert not [fd for fd in fds.iterdir() if str(lock_path) in str(fd.readlink())]
    holder.kill()
    holder.communicate(timeout=10)
    wait_until(lambda: not (Path(f"/proc/{watcher}/fd").exists()
                            and any(Path(f"/proc/{watcher}/fd").iterdir())),
               10, "the watcher gone with its command")


def test_watch_interval_zero_turns_the_watch_off(
    lock_path: Path, procs: list[subprocess.Popen[str]],
) -> None:
    """`--watch-interval 0`: no watcher process, the command is left alone (flock(1) as is)."""
    holder, ready = hold(procs, *FTCTL, "lock", "acquire", "-p", str(lock_path),
                         "--watch-interval", "0", "--", sys.executable, "-c", STUBBORN)
    assert len(ready) == 2, ready  # no watcher among its children
    holder.kill()


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_bad_watch_interval_is_a_usage_error(lock_path: Path, bad: str) -> None:
    """A negative or non-finite --watch-interval exits 2 with one line naming the option."""
    proc = subprocess.run([*FTCTL, "lock", "acquire", "-p", str(lock_path),
                           f"--watch-interval={bad}", "--", "true"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "--watch-interval" in proc.stderr


def test_library_holder_gets_lease_lost(lock_path: Path) -> None:
    """FlockLock: the file deleted by another process calls on_lost, is_held turns False and
    ensure_held raises LeaseLost (exit 5); the next holder's token is higher."""
    told = threading.Event()
    losses: list[LeaseLost] = []

    def on_lost(exc: LeaseLost) -> None:
        losses.append(exc)
        told.set()

    lock = FlockLock(lock_path, engine_id=0, watch_interval_s=0.05, on_lost=on_lost)
    lease = lock.acquire(5)
    assert lock.ensure_held() == lease
    subprocess.run(["rm", str(lock_path)], check=True, timeout=30)
    assert told.wait(10), "the holder was never told"
    assert not lock.is_held
    with pytest.raises(LeaseLost) as info:
        lock.ensure_held()
    assert info.value.exit_code == 5
    assert "was deleted" in str(losses[0])
    assert f"token {lease.token}" in str(losses[0])
    other = FlockLock(lock_path, engine_id=1)
    assert other.acquire(5).token > lease.token
    other.release()
    lock.release()
    assert lock.acquire(5).token > lease.token + 1  # the same object can hold again
    assert lock.ensure_held()
    lock.release()


def test_ensure_held_checks_the_file_itself(lock_path: Path) -> None:
    """With the watch off, ensure_held still sees a replaced file at once (a stat per call)."""
    lock = FlockLock(lock_path, watch_interval_s=0)
    lock.acquire(5)
    (lock_path.parent / "copy").write_text(lock_path.read_text())
    (lock_path.parent / "copy").rename(lock_path)
    with pytest.raises(LeaseLost, match="replaced by another file"):
        lock.ensure_held()
    assert not lock.is_held
    lock.release()


def test_fd_form_refuses_a_descriptor_whose_file_was_deleted(lock_path: Path) -> None:
    """`exec 9<>P; rm P; lock acquire --fd 9`: exit 5, nothing locked (it excludes nobody)."""
    script = (f"exec 9<>{lock_path}\nrm {lock_path}\n"
              f"{sys.executable} -m dynamo_ftctl lock acquire --fd 9; echo rc=$?\n")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    assert "rc=5" in proc.stdout
    assert proc.stderr.count("\n") == 1
    assert "was deleted" in proc.stderr
    assert "reopen it" in proc.stderr


def test_supervised_holder_stops_the_command_and_exits_5(lock_path: Path) -> None:
    """run_holding (the supervising form) with a watched FlockLock: file replaced, the child
    gets SIGTERM and LeaseLost (exit 5) is raised."""
    script = (
        "import sys\n"
        "from dynamo_ftctl.errors import LeaseLost\n"
        "from dynamo_ftctl.lock import FlockLock\n"
        "from dynamo_ftctl.lock.holder import run_holding\n"
        "try:\n"
        "    run_holding(FlockLock(sys.argv[1], watch_interval_s=0.05), sys.argv[2:])\n"
        "except LeaseLost as exc:\n"
        "    print('lost', exc.exit_code, exc, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(lock_path), sys.executable,
                             "-c", TRAPPER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ready")
        lock_path.unlink()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert "got SIGTERM" in out, err
    assert "lost 5" in out
    assert "was deleted" in out



def test_watch_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$FTCTL_LOCK_WATCH_INTERVAL sets the flock watch (for `failover run` too); the flag wins;
    etcd ignores the variable; a bad value is one error naming the variable."""
    from dynamo_ftctl.errors import InvalidInput
    from dynamo_ftctl.lock.settings import resolve_lock_settings

    def resolve(backend: str, flag: float | None = None) -> float:
        return resolve_lock_settings(backend=backend, engine_id=0, path=Path("l"),
                                     watch_interval_s=flag).watch_interval_s

    monkeypatch.delenv("FTCTL_LOCK_WATCH_INTERVAL")  # (the lock tests' short bound)
    assert resolve("flock") == 0.5
    monkeypatch.setenv("FTCTL_LOCK_WATCH_INTERVAL", "0.2")
    assert resolve("flock") == 0.2
    assert resolve("flock", 1.0) == 1.0
    assert resolve("etcd") == 0.5  # a pod-wide variable does not break the etcd backend
    monkeypatch.setenv("FTCTL_LOCK_WATCH_INTERVAL", "soon")
    with pytest.raises(InvalidInput, match=r"\$FTCTL_LOCK_WATCH_INTERVAL"):
        resolve("flock")
    monkeypatch.setenv("FTCTL_LOCK_WATCH_INTERVAL", "-1")
    with pytest.raises(InvalidInput, match=r"\$FTCTL_LOCK_WATCH_INTERVAL: expected seconds"):
        resolve("flock")
