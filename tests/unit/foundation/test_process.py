"""`process`: the one seam that starts, stops and recognises processes (and its fake)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_ftctl import procfs
from dynamo_ftctl.process import PIPE, SPAWNER, Child, FakeSpawner, Identity, Spawner
from tests.waiting import wait_until

# A child that says "ready" once its SIGTERM handler is in place, then sleeps.
IGNORES_TERM = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\n"
                "time.sleep(60)\n")
HONOURS_TERM = "import sys, time\nprint('ready', flush=True)\ntime.sleep(60)\n"


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    """A real spawner whose children are all killed and collected after the test."""
    real = Spawner()
    yield real
    for child in list(real._children.values()):
        child.kill()


def ready(child: Child) -> None:
    """Wait (bounded by the test's timeout) for the child's "ready" line."""
    stream = child.stdout
    assert stream is not None
    assert stream.readline() == b"ready\n"
    stream.close()


def test_stop_sends_term_and_returns_its_status(spawner: Spawner) -> None:
    """A child that honours SIGTERM ends with it, well before the deadline."""
    child = spawner.spawn([sys.executable, "-c", HONOURS_TERM], stdout=PIPE)
    ready(child)
    began = time.monotonic()
    assert child.stop(10.0) == -signal.SIGTERM
    assert time.monotonic() - began < 5.0
    assert not child.alive
    assert child.pid not in spawner._children


def test_stop_kills_a_child_that_ignores_term_at_the_deadline(spawner: Spawner) -> None:
    """SIGTERM ignored: SIGKILL follows once the deadline has passed, not before."""
    child = spawner.spawn([sys.executable, "-c", IGNORES_TERM], stdout=PIPE)
    ready(child)
    began = time.monotonic()
    assert child.stop(0.5) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - began < 5.0


def test_group_stop_reaches_grandchildren(spawner: Spawner, tmp_path: Path) -> None:
    """A group's stop ends a grandchild that ignores SIGTERM and outlives its parent."""
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys\n"
              f"p = subprocess.Popen([sys.executable, '-c', {IGNORES_TERM!r}], "
              f"stdout=subprocess.PIPE)\n"
              f"assert p.stdout.readline() == b'ready\\n'\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              f"print('ready', flush=True)\n"
              f"p.wait()\n")
    child = spawner.spawn([sys.executable, "-c", script], stdout=PIPE, group=True)
    ready(child)
    grandchild = Identity.of(int(pid_file.read_text()))
    assert grandchild is not None
    assert child.stop(0.5) == -signal.SIGTERM  # the parent honours TERM
    assert grandchild.wait_gone(time.monotonic() + 10.0)


def test_a_zombie_is_not_alive(spawner: Spawner) -> None:
    """A child that has exited but is not collected yet reads as ended, not running."""
    child = spawner.spawn([sys.executable, "-c", "print('ready', flush=True)"], stdout=PIPE)
    identity = Identity.of(child.pid)
    ready(child)
    wait_until(lambda: (procfs.stat(child.pid) or ("?",))[0], 10, "the child a zombie",
               accept=lambda state: state == "Z")
    assert identity is not None
    assert not identity.alive
    assert Identity.of(child.pid) is None
    SPAWNER.reap(child.pid)  # not its child: harmless
    spawner.reap(child.pid)
    assert procfs.stat(child.pid) is None


def test_a_reused_pid_is_not_the_process() -> None:
    """The same pid with another start time (a process that got the pid later) is gone."""
    me = Identity.of(os.getpid())
    assert me is not None
    assert me.alive
    assert not Identity(os.getpid(), str(int(me.started) + 1)).alive
    sent: list[tuple[int, int]] = []
    assert not Identity(os.getpid(), "0").signal(signal.SIGTERM,
                                                 kill=lambda p, s: sent.append((p, s)))
    assert sent == []


def test_identity_of_checks_the_command_line(spawner: Spawner) -> None:
    """`marker` picks the process by its arguments: another program under the pid is None."""
    child = spawner.spawn([sys.executable, "-c", HONOURS_TERM, "ftctl-marker"], stdout=PIPE)
    ready(child)
    assert Identity.of(child.pid, marker=b"ftctl-marker") is not None
    assert Identity.of(child.pid, marker=b"another-program") is None
    child.stop(10.0)


def test_identity_stop_kills_after_the_deadline(spawner: Spawner) -> None:
    """A process known only by pid: SIGTERM ignored, SIGKILL at the deadline, then gone."""
    child = spawner.spawn([sys.executable, "-c", IGNORES_TERM], stdout=PIPE)
    ready(child)
    identity = Identity.of(child.pid)
    assert identity is not None
    assert identity.stop(0.3, kill_wait_s=10.0) == signal.SIGKILL
    spawner.reap(child.pid)
    assert child.pid not in spawner._children


def test_spawn_writes_both_streams_to_one_file(spawner: Spawner, tmp_path: Path) -> None:
    """stdout and stderr to the same path share one file, appended to when asked."""
    log = tmp_path / "out" / "log"
    code = "import sys; print('out', flush=True); print('err', file=sys.stderr)"
    for _ in range(2):
        child = spawner.spawn([sys.executable, "-c", code], stdout=log, stderr=log, append=True)
        assert child.wait(30) == 0
    assert log.read_text().split() == ["out", "err", "out", "err"]


def test_run_captures_output_and_kills_at_the_deadline() -> None:
    """`run` returns the output of a command; one past its deadline is killed, timed_out."""
    done = SPAWNER.run([sys.executable, "-c", "print('hi')"], timeout_s=30)
    assert (done.returncode, done.stdout, done.timed_out) == (0, "hi\n", False)
    late = SPAWNER.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.3)
    assert late.timed_out
    with pytest.raises(OSError, match="No such file"):
        SPAWNER.run(["/nonexistent/ftctl-test-binary"], timeout_s=1)


def test_run_async_kills_at_the_deadline() -> None:
    """The asyncio form: stderr captured; a command past its deadline killed and reaped."""
    from dynamo_ftctl.process import run_async

    async def both() -> tuple[str, bool]:
        ok = await run_async([sys.executable, "-c", "import sys; sys.exit('bad')"],
                             timeout_s=30)
        late = await run_async([sys.executable, "-c", "import time; time.sleep(30)"],
                               timeout_s=0.3)
        assert ok.returncode == 1
        return ok.stderr.strip(), late.timed_out

    assert asyncio.run(both()) == ("bad", True)


def test_fake_child_records_term_then_kill_at_the_deadline() -> None:
    """The fake: a child scripted to ignore SIGTERM gets SIGKILL after a wait of the deadline."""
    fake = FakeSpawner(exits_on={})
    child = fake.spawn(["engine", "--port", "1"])
    assert child.alive
    assert child.stop(7.0) == -signal.SIGKILL
    assert child.sent == [signal.SIGTERM, signal.SIGKILL]
    assert child.waits[0] == 7.0
    assert fake.spawned == [child]


def test_fake_group_child_gets_cont_term_and_a_group_kill() -> None:
    """A group's stop resumes it, terminates it, and kills what the leader left behind."""
    child = FakeSpawner().spawn(["engine"], group=True)
    assert child.stop(1.0) == -signal.SIGTERM
    assert child.signals == [(signal.SIGCONT, True), (signal.SIGTERM, True),
                             (signal.SIGKILL, True)]


def test_fake_spawner_scripts_failures_and_runs() -> None:
    """`fail` makes the next spawn raise; `run` records the command and answers it."""
    fake = FakeSpawner(fail=FileNotFoundError(2, "No such file"))
    with pytest.raises(FileNotFoundError):
        fake.spawn(["missing"])
    child = fake.spawn(["ok"])
    child.finish(3)
    assert child.stop(1.0) == 3
    assert child.sent == []
    assert fake.run(["dcgmi", "test"], timeout_s=1).returncode == 0
    assert fake.runs == [["dcgmi", "test"]]
    with pytest.raises(AssertionError, match="never ends"):
        fake.spawn(["forever"]).wait()


def test_a_forked_child_is_stopped_and_collected() -> None:
    """ForkedChild (the lock's watcher is a bare fork): TERM ignored, KILL at the deadline,
    exit status collected; in a fresh interpreter (a fork from the threaded test process
    would warn)."""
    script = ("import os, signal, time\n"
              "from dynamo_ftctl.process import ForkedChild\n"
              "ready_r, ready_w = os.pipe()\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "    os.write(ready_w, b'r')\n"
              "    time.sleep(60)\n"
              "    os._exit(0)\n"
              "assert os.read(ready_r, 1) == b'r'\n"
              "child = ForkedChild(pid)\n"
              "assert child.alive\n"
              "began = time.monotonic()\n"
              "print(child.stop(0.3), child.poll(), time.monotonic() - began >= 0.3)\n")
    done = SPAWNER.run([sys.executable, "-c", script], timeout_s=60)
    assert done.stdout.split() == ["-9", "-9", "True"], done.stderr
