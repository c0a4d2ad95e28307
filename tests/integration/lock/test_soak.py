"""A bounded safety soak: contenders SIGKILLed at random never overlap, tokens never repeat."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.integration

# Each holder creates an O_EXCL sentinel while it holds the lock; a second live
# holder would find it. A sentinel whose pid is dead (or a zombie) was left by a
# holder killed while holding, and is removed.
CONTENDER = Path(__file__).with_name("soak_contender.py").read_text()


def test_three_contenders_killed_at_random_never_overlap(tmp_path: Path) -> None:
    """3 contenders, random SIGKILLs, >= 300 acquisitions: 0 overlaps, no repeated token."""
    path, sentinel = tmp_path / "soak.lock", tmp_path / "soak.sentinel"
    lines: list[str] = []
    guard = threading.Lock()
    rng = random.Random(5)

    acquired = [0, 0, 0]  # acquisitions by each slot's current contender

    def spawn(index: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", CONTENDER, str(path), str(sentinel),
                                 str(index)], stdout=subprocess.PIPE, text=True)
        with guard:
            procs[index] = proc
            acquired[index] = 0
        all_procs.append(proc)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with guard:
                    lines.append(line.strip())
                    if procs[index] is proc:
                        acquired[index] += 1

        threading.Thread(target=pump, daemon=True).start()
        return proc

    procs: list[subprocess.Popen[str] | None] = [None, None, None]
    all_procs: list[subprocess.Popen[str]] = []
    for i in range(3):
        spawn(i)
    kills = 0

    def killed_and_counted() -> int:
        """Lines so far; short of 300, SIGKILL a random contender after a random pause."""
        nonlocal kills
        with guard:
            if len(lines) >= 300:
                return len(lines)
        time.sleep(rng.uniform(0.005, 0.05))  # the soak's pace between kills, not a wait
        victim = rng.randrange(3)
        with guard:
            started = acquired[victim] > 0
            count = len(lines)
        if not started:
            # Killed before it ever acquired, a contender tests nothing: on a loaded
            # host its interpreter start outlasts the kill interval (7 acquisitions
            # in 120 s in CI at load 17).
            return count
        proc = procs[victim]
        assert proc is not None
        proc.kill()
        proc.wait()
        kills += 1
        spawn(victim)
        return count

    try:
        wait_until(killed_and_counted, 120, "300 acquisitions", accept=lambda n: n >= 300,
                   interval=0)
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
