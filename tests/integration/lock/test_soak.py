"""A bounded safety soak: contenders SIGKILLed at random never overlap, tokens never repeat."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# Each holder creates an O_EXCL sentinel while it holds the lock; a second live
# holder would find it. A sentinel whose pid is dead (or a zombie) was left by a
# holder killed while holding, and is removed.
CONTENDER = """
import os, random, sys, time
from dynamo_ftctl.lock import FlockLock
path, sentinel = sys.argv[1], sys.argv[2]
lock = FlockLock(path, int(sys.argv[3]))

def alive(pid):
    # Can `pid` still run user code? Not if it is a zombie, exiting (PF_EXITING:
    # its files, and so its flock, are released before it becomes a zombie) or
    # has SIGKILL pending.
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    sigkill = 1 << 8
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return fields[0] not in "ZX" and not int(fields[6]) & 0x4 and not pending & sigkill

while True:
    lease = lock.acquire()
    while True:
        try:
            fd = os.open(sentinel, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                other = int(open(sentinel).read() or 0)
            except (OSError, ValueError):
                other = 0
            if other and alive(other):
                print(f"OVERLAP {lease.token} {other}", flush=True)
                sys.exit(3)
            os.unlink(sentinel)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    print(lease.token, flush=True)
    time.sleep(random.random() * 0.002)
    os.unlink(sentinel)
    lock.release()
"""


def test_three_contenders_killed_at_random_never_overlap(tmp_path: Path) -> None:
    """3 contenders, random SIGKILLs, >= 300 acquisitions: 0 overlaps, no repeated token."""
    path, sentinel = tmp_path / "soak.lock", tmp_path / "soak.sentinel"
    lines: list[str] = []
    guard = threading.Lock()
    rng = random.Random(5)

    def spawn(index: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", CONTENDER, str(path), str(sentinel),
                                 str(index)], stdout=subprocess.PIPE, text=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with guard:
                    lines.append(line.strip())

        threading.Thread(target=pump, daemon=True).start()
        return proc

    procs = [spawn(i) for i in range(3)]
    all_procs = list(procs)
    deadline = time.monotonic() + 120
    kills = 0
    try:
        while time.monotonic() < deadline:
            with guard:
                if len(lines) >= 300:
                    break
            time.sleep(rng.uniform(0.005, 0.05))
            victim = rng.randrange(3)
            procs[victim].kill()
            procs[victim].wait()
            kills += 1
            procs[victim] = spawn(victim)
            all_procs.append(procs[victim])
    finally:
        for proc in all_procs:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    with guard:
        seen = list(lines)
    overlaps = [line for line in seen if line.startswith("OVERLAP")]
    tokens = [int(line) for line in seen if not line.startswith("OVERLAP")]
    assert len(tokens) >= 300, f"only {len(tokens)} acquisitions in 120 s"
    assert kills > 0
    assert overlaps == []
    assert len(tokens) == len(set(tokens))
