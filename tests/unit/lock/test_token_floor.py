"""Fencing tokens never go backwards, even when the lock file is deleted, replaced, truncated
or forged (issue 22, finding 6): the token floor `P.floor` beside it, and the wall clock
under both (issue 30)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynamo_ftctl.lock import FlockLock
from dynamo_ftctl.lock.flock import floor_path
from dynamo_ftctl.lock.owner import clock_token
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
FTCTL = (sys.executable, "-m", "dynamo_ftctl")

# Acquires and releases in a loop for argv[2] seconds, printing each token.
CONTENDER = """
import sys, time
from dynamo_ftctl.lock import FlockLock
lock = FlockLock(sys.argv[1], settle_s=0)  # about tokens: no settle wait on each new file
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    print(lock.acquire(10).token, flush=True)
    lock.release()
"""


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


def acquire_cli(lock_path: Path) -> subprocess.CompletedProcess[str]:
    """`ftctl lock acquire -p P -- sh -c 'echo $FTCTL_LOCK_TOKEN'` (a separate process)."""
    proc = subprocess.run([*FTCTL, "lock", "acquire", "-p", str(lock_path), "-t", "10", "--",
                           "sh", "-c", "echo $FTCTL_LOCK_TOKEN"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc


def token(lock_path: Path) -> int:
    return int(acquire_cli(lock_path).stdout)


def replace_with(lock_path: Path, content: str) -> None:
    """`mv` a file with `content` over the lock file (a new inode at the path)."""
    other = lock_path.with_name("incoming")
    other.write_text(content)
    other.rename(lock_path)


def test_replacement_claiming_token_1_does_not_restart_the_sequence(lock_path: Path) -> None:
    """A lock file replaced by one claiming token 1: the next token is still above the last."""
    tokens = [token(lock_path) for _ in range(3)]
    assert tokens == sorted(set(tokens))
    replace_with(lock_path, '{"engine_id":0,"token":1}\n')
    assert token(lock_path) > tokens[-1]


def test_deleted_lock_file_does_not_restart_the_sequence(lock_path: Path) -> None:
    """A deleted lock file: the new file's first token is above the last issued."""
    last = [token(lock_path) for _ in range(3)][-1]
    lock_path.unlink()
    assert token(lock_path) > last


def test_forged_higher_token_in_a_replaced_file_is_ignored(lock_path: Path) -> None:
    """A replaced file claiming a token far above the last does not move the sequence: the
    next token is above the last and below the forged one, and a warning names the claim."""
    last = [token(lock_path) for _ in range(2)][-1]
    forged = last + 2**40  # ~4.6 hours of the wall clock's milliseconds above
    replace_with(lock_path, f'{{"engine_id":9,"pid":1,"token":{forged}}}\n')
    proc = acquire_cli(lock_path)
    assert last < int(proc.stdout) < forged
    assert f"claims token {forged}" in proc.stderr
    assert "ignored" in proc.stderr
    assert json.loads(lock_path.read_text())["token"] == int(proc.stdout)


def test_truncation_by_a_write_only_fd_does_not_restart_the_sequence(lock_path: Path) -> None:
    """`exec 9>P` truncates the owner data; `lock acquire --fd 9` still issues above the last."""
    last = [token(lock_path) for _ in range(2)][-1]
    script = (f"exec 9>{lock_path}\n"
              f"{sys.executable} -m dynamo_ftctl lock acquire --fd 9 --json\n")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token"] > last


def test_lock_file_without_a_floor_continues_its_own_sequence(lock_path: Path) -> None:
    """A lock file from before the floor (or whose floor was deleted) continues from its token
    when that is above the wall clock's, and the floor then records the token and the lock
    file's inode."""
    claim = clock_token(time.time()) + 2**40
    lock_path.write_text(f'{{"engine_id":0,"token":{claim}}}\n')
    assert token(lock_path) == claim + 1
    floor = json.loads(floor_path(lock_path).read_text())
    assert floor["token"] == claim + 1
    assert (floor["dev"], floor["ino"]) == (lock_path.stat().st_dev, lock_path.stat().st_ino)
    floor_path(lock_path).unlink()
    assert token(lock_path) == claim + 2


def test_in_place_higher_claim_continues_the_sequence(lock_path: Path) -> None:
    """A token written in place into the file the floor knows (an older ftctl sharing the lock)
    is a continuation: the next token is above it, never a repeat."""
    claim = token(lock_path) + 2**40
    with lock_path.open("r+") as held:  # same inode, as an older version writes it
        held.write(f'{{"engine_id":1,"token":{claim}}}\n')
        held.truncate()
    assert token(lock_path) == claim + 1


def test_both_files_deleted_still_issue_a_higher_token(lock_path: Path) -> None:
    """Deleting the lock file and its floor does not restart the sequence: the wall clock's
    milliseconds, in the token's high bits, are later than at the last token (issue 30)."""
    token(lock_path)
    last = token(lock_path)
    lock_path.unlink()
    floor_path(lock_path).unlink()
    assert token(lock_path) > last


def test_tokens_never_repeat_while_the_file_is_replaced_under_contenders(
    lock_path: Path,
) -> None:
    """3 contender processes for ~3 s while the lock file is deleted or replaced 30 times: no
    token is issued twice, and each contender sees its tokens rise."""
    seconds = 3.0
    contenders = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(lock_path),
                                    str(seconds)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
                  for _ in range(3)]
    outputs: list[str] = ["", "", ""]

    def drain(index: int) -> None:
        outputs[index] = contenders[index].communicate(timeout=60)[0]

    readers = [threading.Thread(target=drain, args=(i,)) for i in range(3)]
    for reader in readers:
        reader.start()
    try:
        wait_until(lock_path.exists, 30, "the first contender's lock file")
        for i in range(30):
            time.sleep(seconds / 40)  # spread the replacements over the contenders' run
            if i % 2:
                replace_with(lock_path, '{"token":1}\n')
            else:
                lock_path.unlink(missing_ok=True)
    finally:
        for reader in readers:
            reader.join(70)
        for proc in contenders:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in contenders)
    per_contender = [[int(line) for line in out.split()] for out in outputs]
    everything = [t for tokens in per_contender for t in tokens]
    assert len(everything) > 30
    assert len(everything) == len(set(everything)), "a token was issued twice"
    for tokens in per_contender:
        assert tokens == sorted(tokens)


def test_floor_records_the_token_before_it_is_handed_out(lock_path: Path) -> None:
    """When acquire returns, the floor already holds the token just given (the floor, not the
    owner data, is what a crash must not lose)."""
    lock = FlockLock(lock_path, watch_interval_s=0)
    lease = lock.acquire(5)
    assert json.loads(floor_path(lock_path).read_text())["token"] == lease.token
    lock.release()


def test_floor_is_beside_the_path_as_named(tmp_path: Path) -> None:
    """The floor of P is P.floor in P's directory, never beside what a link points to."""
    assert floor_path(tmp_path / "x.lock") == tmp_path / "x.lock.floor"


def test_a_symlinked_lock_path_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """Issue 30 case 1: a lock path replaced by a link to a file elsewhere is refused (exit
    2, one line naming it); the target keeps its bytes and gets no floor beside it. A shell
    that opens the link itself (`exec 9<>LINK; --fd 9`) chose to follow it: that works."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    link = tmp_path / "link.lock"
    link.symlink_to(victim)
    proc = subprocess.run([*FTCTL, "lock", "acquire", "-p", str(link), "-t", "5", "--",
                           "true"], capture_output=True, text=True, timeout=60, check=False,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert str(link) in proc.stderr
    assert victim.read_bytes() == b"precious\n"
    assert not (tmp_path / "victim.floor").exists()
    target = tmp_path / "real.lock"
    (tmp_path / "fd.lock").symlink_to(target)
    script = f"exec 9<>{tmp_path / 'fd.lock'}\n{sys.executable} -m dynamo_ftctl lock acquire --fd 9 --json\n"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token"] > 0
    assert (tmp_path / "real.lock.floor").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "hardlink"])
def test_a_planted_floor_is_refused_and_its_target_untouched(tmp_path: Path,
                                                            kind: str) -> None:
    """Issue 30 case 1: a link (or FIFO, or second name) planted at P.floor is refused;
    nothing is written to what it points at, and nothing hangs."""
    lock = tmp_path / "failover.lock"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    floor = tmp_path / "failover.lock.floor"
    if kind == "symlink":
        floor.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(floor)
    else:
        os.link(victim, floor)
    proc = subprocess.run([*FTCTL, "lock", "acquire", "-p", str(lock), "-t", "5", "--",
                           "true"], capture_output=True, text=True, timeout=60, check=False,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert str(floor) in proc.stderr
    assert victim.read_bytes() == b"precious\n"
