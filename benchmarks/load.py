"""How much load can one `ftctl load` process generate with honest timing, and what does it add?

1. Highest open-loop rate one process sustains with schedule lag (planned → sent) p99
   <= 1 ms (and every request answered) in 2 of 3 trials of a rate, against the
   trivial loopback target (`dynamo_ftctl.loadgen.target`, pinned to CPU 0; the
   generator runs on CPU 1): non-streaming requests/s, and streamed tokens/s (64
   tokens per request), for each client (`--clients`: http1, the one client since
   the aiohttp fallback went; compare with an older checkout run the same way).
   `wrk` (C, closed loop, 32 connections) on the same server in the same run is the
   ceiling. (First, 0.: the generator's CPU
   per request in a closed loop, which others on the machine disturb less.) The
   machine is shared: each trial waits (at most 30 s) for a moment when other
   processes use at most 15% of the CPUs (from /proc), and one during which they
   used more is run again, at most 2 times per rate; the output says how many were.
2. Overhead: TTFT as `ftctl load` measures it (from the actual send) minus TTFT as
   the server measures it, p50, streaming, at a light rate: on `ftctl sim` (which
   reports its own TTFT of each stream as `ftctl_server_ttft_ms` in the finishing
   chunk: request arrival -> first token chunk handed to the socket; the load
   generator keeps it per request), and on the loopback target (request read ->
   first token written, from its `/stats`), for each client.

Run: .venv/bin/python benchmarks/load.py [--seconds 3] [--clients http1]
     [--at 3000,4000 --at-stream 800]  (vote at those rates instead of bisecting)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from dynamo_ftctl.loadgen import Length, LoadConfig, Schedule, Workload, run_load
from dynamo_ftctl.loadgen.config import Client

LAG_P99_MS = 1.0
STATS = {"trials": 0, "disturbed": 0, "busy_votes": 0, "busy_starts": 0}


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") else []


@contextmanager
def target(*extra: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [*_pin(0), sys.executable, "-m", "dynamo_ftctl.loadgen.target", "--port", "0", *extra],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        match = re.search(r"listening on (\S+):(\d+)", proc.stdout.readline())
        if not match:
            raise RuntimeError("target did not start")
        MINE["target"] = proc.pid
        yield f"http://{match.group(1)}:{match.group(2)}"
    finally:
        MINE.pop("target", None)
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


# Spin before each send as the benchmark's trials do (`--spin-us`); 5 ms by default,
# as the figures before it became an option: on this shared VM a process that sleeps
# waits for its CPU when others are busy, and a longer spin keeps it on its core.
SPIN = {"s": 0.005}


# Processes of this benchmark whose CPU is not "someone else's" (besides itself).
MINE: dict[str, int] = {}
# A trial during which other processes used more than this share of all CPUs is run
# again (at most DISTURBED_RETRIES times per rate): it measured them, not the generator.
DISTURBED = 0.15
DISTURBED_RETRIES = 2


def _jiffies() -> tuple[int, int, int]:
    """(all CPUs' ticks, their busy ticks, this benchmark's own ticks) from /proc."""
    total = busy = 0
    with Path("/proc/stat").open() as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                values = [int(t) for t in line.split()[1:]]
                total += sum(values)
                busy += sum(values) - values[3] - values[4]  # less idle and iowait
    own = 0
    for pid in (os.getpid(), *MINE.values()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        own += int(fields[11]) + int(fields[12])  # utime, stime
    return total, busy, own


def wait_for_quiet(limit_s: float = 30.0) -> None:
    """Wait (at most `limit_s`) until others use at most DISTURBED of the CPUs for 0.5 s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = _jiffies()
        time.sleep(0.5)
        if others_share(before, _jiffies()) <= DISTURBED:
            return
    STATS["busy_starts"] += 1


def others_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """Share of all CPUs that other processes used between two `_jiffies()`."""
    total = after[0] - before[0]
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others / total) if total > 0 else 0.0


def trial(url: str, rate: float, seconds: float, *, stream: bool,
          client: Client) -> tuple[bool, dict[str, float]]:
    """One open-loop run; sustained when lag p99 <= 1 ms and every request completed."""
    wait_for_quiet()
    before = _jiffies()
    report = run_load(LoadConfig(
        targets=(url,), schedule=Schedule(rate=rate, arrival="poisson", seed=1), client=client,
        spin_s=SPIN["s"],
        workload=Workload(stream=stream, max_tokens=Length.fixed(64 if stream else 16),
                          prompt_tokens=Length.fixed(16), model="m"),
        duration_s=seconds, warmup_s=min(0.5, seconds / 4), timeout_s=10))
    s = report.summary
    ok = (s.queue_ms.p99 <= LAG_P99_MS and s.failed == 0
          and s.completed == s.planned_requests)
    return ok, {"rate": rate, "others": others_share(before, _jiffies()),
                "lag_p99_ms": s.queue_ms.p99, "req_s": s.requests_per_s,
                "tok_s": s.output_tokens_per_s, "ttft_p50_ms": s.ttft_from_sent_ms.p50}


def sustained(url: str, rate: float, seconds: float, *, stream: bool,
              client: Client) -> tuple[bool, dict[str, float]]:
    """A rate is sustained when 2 of 3 trials meet it (a single trial is at the mercy of
    whoever else runs on this shared machine; stops as soon as the vote is decided). A
    trial during which other processes used more than 15% of the CPUs does not vote
    and is run again, up to 2 times per rate."""
    votes: list[bool] = []
    rows: list[dict[str, float]] = []
    retries = 0
    while votes.count(True) < 2 and votes.count(False) < 2:
        ok, row = trial(url, rate, seconds, stream=stream, client=client)
        disturbed = row["others"] > DISTURBED and retries < DISTURBED_RETRIES
        verdict = "disturbed" if disturbed else ("ok" if ok else "no")
        print(f"   {client:<8} rate {rate:8,.0f}/s  lag p99 {row['lag_p99_ms']:7.3f} ms  "
              f"others {row['others']:4.0%}  {verdict}", flush=True)
        STATS["trials"] += 1
        if disturbed:
            retries += 1
            STATS["disturbed"] += 1
            continue
        STATS["busy_votes"] += row["others"] > DISTURBED
        votes.append(ok)
        rows.append(row)
    passed = votes.count(True) >= 2
    good = [r for r, v in zip(rows, votes, strict=True) if v == passed]
    return passed, min(good, key=lambda r: r["req_s"])


def highest_rate(url: str, seconds: float, *, stream: bool, client: Client) -> dict[str, float]:
    """Bisect the highest sustained rate (5 steps after bracketing by doubling)."""
    low, high = 0.0, 250.0
    best: dict[str, float] = {"rate": 0.0, "lag_p99_ms": float("nan"), "req_s": 0.0,
                              "tok_s": 0.0}
    while True:  # double until it fails (bounded: 250 * 2^7 = 32k req/s)
        ok, row = sustained(url, high, seconds, stream=stream, client=client)
        if not ok or high >= 32_000:
            break
        best, low, high = row, high, high * 2
    for _ in range(5):
        mid = (low + high) / 2
        ok, row = sustained(url, mid, seconds, stream=stream, client=client)
        if ok:
            best, low = row, mid
        else:
            high = mid
    return best


def wrk(url: str, seconds: float, *, stream: bool) -> float:
    body = json.dumps({"model": "m", "prompt": "x" * 16, "max_tokens": 64 if stream else 16,
                       "stream": stream})
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(f'wrk.method = "POST"\nwrk.body = \'{body}\'\n'
                          'wrk.headers["Content-Type"] = "application/json"\n')
        out = subprocess.run([*_pin(1), "wrk", "-t1", "-c32", f"-d{max(1, round(seconds))}s",
                              "-s", str(script), url + "/v1/completions"],
                             capture_output=True, text=True, check=True,
                             timeout=seconds + 30).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise RuntimeError(out)
    return float(match.group(1))


def overhead_on_target(seconds: float, client: Client) -> tuple[float, float]:
    """(client TTFT p50, server TTFT p50) in ms, streaming at a light 50 req/s."""
    with target("--latency", "0.005") as url:
        report = run_load(LoadConfig(
            targets=(url,), schedule=Schedule(rate=50, seed=2), client=client,
            workload=Workload(stream=True, max_tokens=Length.fixed(16), model="m"),
            duration_s=seconds))
        with urllib.request.urlopen(url + "/stats", timeout=10) as resp:
            server = json.load(resp)["ttft_s"]
    return report.summary.ttft_from_sent_ms.p50, statistics.median(server) * 1000


def overhead_on_sim(seconds: float, clients: list[Client],
                    ) -> dict[Client, tuple[float, float, float, int]]:
    """Per client: (client TTFT p50, server TTFT p50, per-request difference p50) in ms, and
    the number of samples; the clients take turns on one engine (two runs each)."""
    from dynamo_ftctl.engine.launcher import start_worker

    worker = start_worker("bench-load", timeout_s=120)
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:  # the engine on CPU 0
        subprocess.run(["taskset", "-a", "-p", "-c", "0", str(worker.pid)],
                       check=False, capture_output=True)
    pairs: dict[Client, list[tuple[float, float]]] = {c: [] for c in clients}
    try:
        for _ in range(2):
            for client in clients:
                # One request at a time (constant 5/s, 4 tokens: ~15 ms each), so that none
                # arrives while the engine is inside a step: the step runs on the server's
                # event loop, and a request waiting behind it is late for the server's clock.
                report = run_load(LoadConfig(
                    targets=(worker.url,), schedule=Schedule(rate=5, arrival="constant", seed=3),
                    workload=Workload(stream=True, max_tokens=Length.fixed(4),
                                      prompt_tokens=Length.fixed(64), ignore_eos=True),
                    duration_s=seconds / 2, warmup_s=1.0, timeout_s=30, client=client))
                pairs[client] += [(r.ttft_from_sent_s, r.server_ttft) for r in report.records
                                  if r.ok and not r.warmup and r.ttft_from_sent_s is not None
                                  and r.server_ttft is not None]
    finally:
        worker.stop()
    out: dict[Client, tuple[float, float, float, int]] = {}
    for client, got in pairs.items():
        if not got:
            raise RuntimeError("ftctl sim reported no server TTFT")
        out[client] = (statistics.median(c for c, _ in got) * 1000,
                       statistics.median(s for _, s in got) * 1000,
                       statistics.median(c - s for c, s in got) * 1000, len(got))
    return out


def cpu_per_request(url: str, seconds: float, *, stream: bool, client: Client) -> float:
    """Generator CPU (user + system) per completed request in us, closed loop, 32 users:
    what one request costs the generator, whoever else runs (CPU time, not lag)."""
    start = os.times()
    report = run_load(LoadConfig(
        targets=(url,), schedule=Schedule(users=32), client=client,
        workload=Workload(stream=stream, max_tokens=Length.fixed(64 if stream else 16),
                          prompt_tokens=Length.fixed(16), model="m"),
        duration_s=seconds, timeout_s=10))
    end = os.times()
    used = (end.user - start.user) + (end.system - start.system)
    return used / max(1, report.summary.completed) * 1e6


def vote_at(args: argparse.Namespace, clients: list[Client]) -> int:
    """`--at`/`--at-stream`: the 2-of-3 vote at given rates (a bisection that hits one
    unlucky vote on the way up never looks above it; this checks a rate directly)."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    for stream, rates in ((False, args.at), (True, args.at_stream)):
        for rate in (float(r) for r in rates.split(",") if r.strip()):
            with target() as url:
                for client in clients:
                    ok, row = sustained(url, rate, args.seconds, stream=stream, client=client)
                    print(f" {client:<8} {'streamed' if stream else 'not streamed':<13} "
                          f"{rate:7,.0f}/s: {'sustained' if ok else 'not sustained'} "
                          f"({row['req_s']:,.0f} req/s, {row['tok_s']:,.0f} tokens/s)",
                          flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", default="http1",
                        help="comma-separated clients to measure (http1)")
    parser.add_argument("--spin-us", type=int, default=round(SPIN["s"] * 1e6),
                        help="the trials' --spin-us")
    parser.add_argument("--at", default="", metavar="R1,R2",
                        help="instead of bisecting, vote on these non-streaming rates only")
    parser.add_argument("--at-stream", default="", metavar="R1,R2",
                        help="instead of bisecting, vote on these streaming rates only")
    args = parser.parse_args()
    SPIN["s"] = args.spin_us / 1e6
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups
    clients = [cast("Client", c.strip()) for c in args.clients.split(",") if c.strip()]
    if args.at or args.at_stream:
        return vote_at(args, clients)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # the generator on CPU 1, the target on CPU 0
    print(f"== 0. generator CPU per request (closed loop, 32 users, {args.seconds:g} s, "
          "median of 3)")
    with target() as url:
        for stream in (False, True):
            for client in clients:
                runs = sorted(cpu_per_request(url, args.seconds, stream=stream, client=client)
                              for _ in range(3))
                print(f" {client:<8} {'streamed, 64 tokens' if stream else 'not streamed':<20}"
                      f"{runs[1]:8,.0f} us/request  ({', '.join(f'{r:,.0f}' for r in runs)})",
                      flush=True)
    print(f"== 1. highest rate with schedule lag p99 <= {LAG_P99_MS} ms "
          f"(Poisson arrivals, {args.seconds:g} s per trial, spin {args.spin_us} us)")
    best: dict[tuple[Client, bool], dict[str, float]] = {}
    ceiling: dict[bool, float] = {}
    for stream in (False, True):
        with target() as url:
            print(" streaming, 64 tokens:" if stream else " non-streaming, 16 tokens:")
            for client in clients:
                best[client, stream] = highest_rate(url, args.seconds, stream=stream,
                                                    client=client)
            ceiling[stream] = wrk(url, args.seconds, stream=stream)
    print(f"{'':<28}{'non-streaming req/s':>22}{'streamed tokens/s':>20}{'lag p99 (ms)':>16}")
    for client in clients:
        plain, streamed = best[client, False], best[client, True]
        print(f"{'ftctl load --client ' + client:<28}{plain['req_s']:>22,.0f}"
              f"{streamed['tok_s']:>20,.0f}"
              f"{plain['lag_p99_ms']:>8.3f}/{streamed['lag_p99_ms']:.3f}")
    print(f"{'wrk (closed, 32 conns)':<28}{ceiling[False]:>22,.0f}{ceiling[True] * 64:>20,.0f}")
    for client in clients:
        print(f"  {client}: {best[client, False]['req_s'] / ceiling[False]:.2f} of wrk's "
              f"requests/s, {best[client, True]['tok_s'] / (ceiling[True] * 64):.2f} of its "
              f"tokens/s")
    print(f"  ({STATS['trials']} trials; {STATS['disturbed']} re-run because other processes "
          f"used > {DISTURBED:.0%} of the CPUs; {STATS['busy_votes']} votes counted though "
          f"disturbed, after 2 re-runs; {STATS['busy_starts']} started after 30 s without a "
          "quiet moment)")
    print("== 2. TTFT overhead: ftctl load's TTFT (from send) minus the server's own, p50")
    for client, (c, srv, diff, n) in overhead_on_sim(max(args.seconds * 4, 10.0),
                                                     clients).items():
        print(f" ftctl sim, {client:<8} (64-token prompt, 5 req/s, {n} streams): client "
              f"{c:.3f} ms, server {srv:.3f} ms, overhead {c - srv:+.3f} ms "
              f"(per-request difference p50 {diff:+.3f} ms; goal <= 1 ms)")
    for client in clients:
        c, srv = overhead_on_target(args.seconds, client)
        print(f" loopback target, {client:<8} (5 ms to first token): client {c:.3f} ms, "
              f"server {srv:.3f} ms, overhead {c - srv:+.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
