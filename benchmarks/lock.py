"""Failover lock figures (issues 5 and 25): handoff latency, safety soak, failover time.

1. Handoff latency, holder SIGKILLed -> waiter holds the lock, `--trials` each,
   all cases interleaved trial by trial: `ftctl lock acquire --path P -- date`
   beside `flock P date` (the exec path), `exec 9<>P; ftctl lock acquire --fd 9;
   date` beside `exec 9<>P; flock 9; date` (the --fd path), and the library's
   `FlockLock.acquire` (time taken when it returns). The time is printed by
   `date` once the waiter holds the lock. All wait on a lock held by `sleep`;
   the kill is sent once the kernel lists the waiter as blocked (/proc/locks),
   0.1 s later, with the blocked waiter made SCHED_FIFO (the same for every
   case; `--no-realtime` leaves it), so a loaded machine's run queue does not
   decide. Goals (issue 25): ftctl/flock(1) p50 <= 1.2x and p99 <= 1.5x on both
   paths, printed MET or NOT MET.
2. Safety soak: 3 contender processes acquire/hold/release in a loop while
   random ones are SIGKILLed and restarted, until 2,000 acquisitions; each
   holder creates an O_EXCL sentinel file, so two holders at once would
   collide (a sentinel left by a dead holder is recognised by its pid).
   Must be 0 overlaps and no repeated fencing token.
3. Failover time with `ftctl sim`: two `ftctl failover run` engines; the active
   engine is SIGKILLed; time to the first successful completion from the
   shadow (goal <= 1 s). A few trials; median.

The machine is shared and has 2 cores: run it a couple of times and take the median.
Usage: python benchmarks/lock.py [--trials 25] [--cycles 2000] [--failovers 3]
       [--only handoff|soak|failover] [--no-realtime]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dynamo_ftctl.lock.flock import FlockLock

WAITER = """
import sys, time
from dynamo_ftctl.lock import FlockLock
lock = FlockLock(sys.argv[1], 1)
lock.acquire()
print(f"{time.time():.9f}", flush=True)
"""

# The holder all waiters wait on: a bare flock held by `sleep` (flock(1) forks its
# command, which inherits the locked descriptor, so killing flock(1) alone frees nothing).
HOLDER = ["sh", "-c", 'exec 9<>"$0"; flock 9; echo held; exec sleep 1000']

# The same contender the soak test runs (one copy of the overlap checker).
CONTENDER = (Path(__file__).resolve().parents[1] / "tests" / "integration" / "lock"
             / "soak_contender.py").read_text()


def blocked_pids(path: Path) -> list[int]:
    """The processes the kernel lists as blocked on the lock file (/proc/locks)."""
    inode = path.stat().st_ino
    return [int(line.split()[5]) for line in Path("/proc/locks").read_text().splitlines()
            if "->" in line and f":{inode} " in line]


def wait_blocked(path: Path, deadline_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + deadline_s
    while not (pids := blocked_pids(path)):
        if time.monotonic() > deadline:
            msg = "waiter never blocked"
            raise RuntimeError(msg)
        time.sleep(0.0005)
    return pids


def make_realtime(pids: list[int]) -> bool:
    """SCHED_FIFO for every thread of `pids` (what runs after the grant inherits it), so
    that on a loaded machine the figure is the path's cost, not the scheduler's queue;
    False when not allowed."""
    try:
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.sched_setscheduler(int(task.name), os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, FileNotFoundError, ProcessLookupError):
        return False
    return True


def one_handoff(path: Path, waiter_argv: list[str], *, realtime: bool) -> float:
    holder = subprocess.Popen([*HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    holder.stdout.readline()
    waiter = subprocess.Popen(waiter_argv, stdout=subprocess.PIPE, text=True)
    try:
        blocked = wait_blocked(path)
        # "Already blocked": let what the waiter started before blocking (ftctl's
        # watcher interpreter) settle, as it has in a pod whose shadow waits for minutes.
        time.sleep(SETTLE_S)
        if realtime:  # the blocked process and the shell around it (the --fd forms)
            make_realtime(sorted({*blocked, waiter.pid}))
        t0 = time.time()
        holder.send_signal(signal.SIGKILL)
        out, _ = waiter.communicate(timeout=30)
        return float(out.strip()) - t0
    finally:
        for proc in (holder, waiter):
            proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# The CLI handoff cases, each beside its flock(1) anchor (issue 25): the time is
# printed by `date`, which the waiter runs once it holds the lock.
FTCTL = [sys.executable, "-m", "dynamo_ftctl", "lock", "acquire"]
DATE = ["date", "+%s.%N"]
# Pause between "the waiter is blocked" and the kill, for every waiter alike.
SETTLE_S = 0.1
# Goals (issue 25): ftctl/flock(1) at most this at p50 and at p99, on both paths.
GOAL_P50, GOAL_P99 = 1.2, 1.5


def cli_cases(path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Per path (exec, --fd): the ftctl waiter and its flock(1) anchor."""
    ftctl_fd = " ".join([*FTCTL, "--fd", "9"])
    return {
        "exec": ([*FTCTL, "--path", str(path), "--", *DATE], ["flock", str(path), *DATE]),
        "--fd": (["sh", "-c", f'exec 9<>"$0"; {ftctl_fd} >/dev/null && exec date +%s.%N',
                  str(path)],
                 ["sh", "-c", 'exec 9<>"$0"; flock 9 && exec date +%s.%N', str(path)]),
    }


def handoff(trials: int, workdir: Path, *, realtime: bool = True) -> dict[str, bool]:
    """Handoff latencies, every case interleaved trial by trial; MET per goal."""
    path = workdir / "handoff.lock"
    path.touch()
    # A lock file the token floor has not seen is held for the stop bound (6 s) once, on its
    # first acquisition (docs/lock.md): taken here, so that no sample pays it.
    first = FlockLock(path, watch_interval_s=0, settle_s=0)
    first.acquire()
    first.release()
    cases: dict[str, list[str]] = {"ftctl FlockLock (library)": [sys.executable, "-c", WAITER,
                                                                 str(path)]}
    pairs = cli_cases(path)
    for form, (ftctl, anchor) in pairs.items():
        cases[f"ftctl {form}"] = ftctl
        cases[f"flock(1) {form}"] = anchor
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(trials):  # interleaved: noise hits all alike
        for name, argv in cases.items():
            samples[name].append(one_handoff(path, argv, realtime=realtime) * 1000)
    print(f"\n1. handoff latency, holder SIGKILLed -> waiter holds ({trials} trials each, "
          f"interleaved; ms; waiters {'SCHED_FIFO' if realtime else 'not'} once blocked)")
    print(f"{'waiter':<28}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    for name, values in samples.items():
        print(f"{name:<28}{pct(values, 0.5):>8.3f}{pct(values, 0.9):>8.3f}"
              f"{pct(values, 0.99):>8.3f}{max(values):>8.3f}")
    print(f"\n{'ratio ftctl/flock(1)':<28}{'p50':>8}{'p99':>8}   goal p50 <= {GOAL_P50}x, "
          f"p99 <= {GOAL_P99}x")
    met: dict[str, bool] = {}
    for form in pairs:
        ours, anchor = samples[f"ftctl {form}"], samples[f"flock(1) {form}"]
        r50 = pct(ours, 0.5) / pct(anchor, 0.5)
        r99 = pct(ours, 0.99) / pct(anchor, 0.99)
        met[f"{form} p50"], met[f"{form} p99"] = r50 <= GOAL_P50, r99 <= GOAL_P99
        print(f"{form:<28}{r50:>8.2f}{r99:>8.2f}   p50 "
              f"{'MET' if r50 <= GOAL_P50 else 'NOT MET'}, p99 "
              f"{'MET' if r99 <= GOAL_P99 else 'NOT MET'}")
    return met


def soak(cycles: int, workdir: Path, time_limit_s: float = 600.0) -> None:
    path, sentinel = workdir / "soak.lock", workdir / "soak.sentinel"
    tokens: list[int] = []
    overlaps: list[str] = []
    guard = threading.Lock()
    kills = 0

    def spawn(index: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", CONTENDER, str(path), str(sentinel),
                                 str(index)], stdout=subprocess.PIPE, text=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with guard:
                    if line.startswith("OVERLAP"):
                        overlaps.append(line.strip())
                    else:
                        tokens.append(int(line))

        threading.Thread(target=pump, daemon=True).start()
        return proc

    procs = [spawn(i) for i in range(3)]
    started = time.monotonic()
    try:
        while True:
            with guard:
                done = len(tokens) >= cycles
            if done or time.monotonic() - started > time_limit_s:
                break
            time.sleep(random.uniform(0.005, 0.05))
            victim = random.randrange(3)
            procs[victim].kill()
            procs[victim].wait()
            kills += 1
            procs[victim] = spawn(victim)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - started
    with guard:
        got = list(tokens)
    repeats = len(got) - len(set(got))
    print(f"\n2. safety soak: 3 contenders, {kills} random SIGKILLs, {len(got)} acquisitions "
          f"in {elapsed:.1f} s")
    print(f"overlapping holders (O_EXCL sentinel): {len(overlaps)}   repeated tokens: {repeats}"
          f"   token range {min(got)}..{max(got)}   "
          f"{'OK' if not overlaps and not repeats else 'FAILED'}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """One `ftctl failover run` wrapping `ftctl sim serve`."""

    def __init__(self, engine_id: int, lock: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_ftctl", "failover", "run", "--json", "--engine-id",
             str(engine_id), "--health-port", str(free_port()), "--path", str(lock),
             "--engine-url", self.url, "--", sys.executable, "-m", "dynamo_ftctl", "sim",
             "serve", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self.engine_pid = 0

    def wait_state(self, state: str, timeout: float = 180.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            doc = json.loads(line)
            self.engine_pid = doc["engine_pid"]
            if doc["state"] == state:
                return
            if time.monotonic() > deadline:
                break
        msg = f"engine never reached {state}"
        raise RuntimeError(msg)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def failover(trials: int, workdir: Path) -> None:
    lock = workdir / "failover.lock"
    body = {"model": "ftctl-sim-tiny", "prompt": "hello", "max_tokens": 1}
    times: list[float] = []
    active = Engine(0, lock)
    engines = [active]
    try:
        active.wait_state("ACTIVE")
        with httpx.Client(timeout=5) as client:
            for trial in range(trials):
                shadow = Engine(trial + 1, lock)
                engines.append(shadow)
                shadow.wait_state("STANDBY")
                t0 = time.monotonic()
                os.kill(active.engine_pid, signal.SIGKILL)
                deadline = t0 + 30
                while time.monotonic() < deadline:
                    try:
                        if client.post(f"{shadow.url}/v1/completions",
                                       json=body).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                times.append(time.monotonic() - t0)
                active.proc.wait(30)
                active = shadow
    finally:
        for engine in engines:
            engine.stop()
    print(f"\n3. failover time with ftctl sim (primary engine SIGKILLed -> first completion "
          f"from the shadow), {trials} trials")
    print("seconds: " + ", ".join(f"{t:.3f}" for t in times)
          + f"   median {statistics.median(times):.3f} s "
          f"(goal <= 1 s: {'met' if statistics.median(times) <= 1 else 'NOT met'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=25)
    parser.add_argument("--no-realtime", action="store_true",
                        help="leave the blocked waiters at normal priority")
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--failovers", type=int, default=3)
    parser.add_argument("--only", choices=["handoff", "soak", "failover"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftctl-lock-bench-") as raw:
        workdir = Path(raw)
        if args.only in (None, "handoff"):
            handoff(args.trials, workdir, realtime=not args.no_realtime)
        if args.only in (None, "soak"):
            soak(args.cycles, workdir)
        if args.only in (None, "failover"):
            failover(args.failovers, workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
