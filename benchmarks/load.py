"""How much load can one `ftctl load` process generate with honest timing, and what does it add?

1. Highest open-loop rate one process sustains with schedule lag (planned → sent) p99
   <= 1 ms (and every request answered) in 2 of 3 trials of a rate, against the
   trivial loopback target (`dynamo_ftctl.loadgen.target`, pinned to CPU 0; the
   generator runs on CPU 1): non-streaming requests/s, and streamed tokens/s (64
   tokens per request). `wrk` (C, closed loop, 32 connections) on the same server
   in the same run is the ceiling.
2. Overhead: TTFT as `ftctl load` measures it (from the actual send) minus TTFT as
   the server measures it, p50, streaming, at a light rate: on `ftctl sim` (which
   reports its own TTFT of each stream as `ftctl_server_ttft_ms` in the finishing
   chunk: request arrival -> first token chunk handed to the socket; the load
   generator keeps it per request), and on the loopback target (request read ->
   first token written, from its `/stats`).

Run: .venv/bin/python benchmarks/load.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dynamo_ftctl.loadgen import Length, LoadConfig, Schedule, Workload, run_load

LAG_P99_MS = 1.0


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
        yield f"http://{match.group(1)}:{match.group(2)}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def trial(url: str, rate: float, seconds: float, *, stream: bool) -> tuple[bool, dict[str, float]]:
    """One open-loop run; sustained when lag p99 <= 1 ms and every request completed."""
    report = run_load(LoadConfig(
        targets=(url,), schedule=Schedule(rate=rate, arrival="poisson", seed=1),
        workload=Workload(stream=stream, max_tokens=Length.fixed(64 if stream else 16),
                          prompt_tokens=Length.fixed(16), model="m"),
        duration_s=seconds, warmup_s=min(0.5, seconds / 4), timeout_s=10))
    s = report.summary
    ok = (s.queue_ms.p99 <= LAG_P99_MS and s.failed == 0
          and s.completed == s.planned_requests)
    return ok, {"rate": rate, "lag_p99_ms": s.queue_ms.p99, "req_s": s.requests_per_s,
                "tok_s": s.output_tokens_per_s, "ttft_p50_ms": s.ttft_from_sent_ms.p50}


def sustained(url: str, rate: float, seconds: float, *,
              stream: bool) -> tuple[bool, dict[str, float]]:
    """A rate is sustained when 2 of 3 trials meet it (a single trial is at the mercy of
    whoever else runs on this shared machine; stops as soon as the vote is decided)."""
    votes: list[bool] = []
    rows: list[dict[str, float]] = []
    while votes.count(True) < 2 and votes.count(False) < 2:
        ok, row = trial(url, rate, seconds, stream=stream)
        votes.append(ok)
        rows.append(row)
        print(f"   rate {rate:8,.0f}/s  lag p99 {row['lag_p99_ms']:6.3f} ms  "
              f"{'ok' if ok else 'no'}", flush=True)
    passed = votes.count(True) >= 2
    good = [r for r, v in zip(rows, votes, strict=True) if v == passed]
    return passed, min(good, key=lambda r: r["req_s"])


def highest_rate(url: str, seconds: float, *, stream: bool) -> dict[str, float]:
    """Bisect the highest sustained rate (5 steps after bracketing by doubling)."""
    low, high = 0.0, 250.0
    best: dict[str, float] = {"rate": 0.0, "lag_p99_ms": float("nan"), "req_s": 0.0,
                              "tok_s": 0.0}
    while True:  # double until it fails (bounded: 250 * 2^7 = 32k req/s)
        ok, row = sustained(url, high, seconds, stream=stream)
        if not ok or high >= 32_000:
            break
        best, low, high = row, high, high * 2
    for _ in range(5):
        mid = (low + high) / 2
        ok, row = sustained(url, mid, seconds, stream=stream)
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


def overhead_on_target(seconds: float) -> tuple[float, float]:
    """(client TTFT p50, server TTFT p50) in ms, streaming at a light 50 req/s."""
    with target("--latency", "0.005") as url:
        report = run_load(LoadConfig(
            targets=(url,), schedule=Schedule(rate=50, seed=2),
            workload=Workload(stream=True, max_tokens=Length.fixed(16), model="m"),
            duration_s=seconds))
        with urllib.request.urlopen(url + "/stats", timeout=10) as resp:
            server = json.load(resp)["ttft_s"]
    client = report.summary.ttft_from_sent_ms.p50
    return client, statistics.median(server) * 1000


def overhead_on_sim(seconds: float) -> tuple[float, float, float, int]:
    """(client TTFT p50, server TTFT p50, per-request difference p50) in ms, and samples."""
    from dynamo_ftctl.engine.launcher import start_worker

    worker = start_worker("bench-load", timeout_s=120)
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:  # the engine on CPU 0
        subprocess.run(["taskset", "-a", "-p", "-c", "0", str(worker.pid)],
                       check=False, capture_output=True)
    try:
        # One request at a time (constant 5/s, 4 tokens: ~15 ms each), so that none
        # arrives while the engine is inside a step: the step runs on the server's event
        # loop, and a request waiting behind it is late for the server's clock only.
        report = run_load(LoadConfig(
            targets=(worker.url,), schedule=Schedule(rate=5, arrival="constant", seed=3),
            workload=Workload(stream=True, max_tokens=Length.fixed(4),
                              prompt_tokens=Length.fixed(64), ignore_eos=True),
            duration_s=seconds, warmup_s=1.0, timeout_s=30))
    finally:
        worker.stop()
    pairs = [(r.ttft_from_sent_s, r.server_ttft) for r in report.records
             if r.ok and not r.warmup and r.ttft_from_sent_s is not None
             and r.server_ttft is not None]
    if not pairs:
        raise RuntimeError("ftctl sim reported no server TTFT")
    client = statistics.median(c for c, _ in pairs) * 1000
    server = statistics.median(s for _, s in pairs) * 1000
    diff = statistics.median(c - s for c, s in pairs) * 1000
    return client, server, diff, len(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # the generator on CPU 1, the target on CPU 0
    print(f"== 1. highest rate with schedule lag p99 <= {LAG_P99_MS} ms "
          f"(Poisson arrivals, {args.seconds:g} s per trial)")
    with target() as url:
        print(" non-streaming, 16 tokens:")
        plain = highest_rate(url, args.seconds, stream=False)
        wrk_plain = wrk(url, args.seconds, stream=False)
    with target() as url:
        print(" streaming, 64 tokens:")
        streamed = highest_rate(url, args.seconds, stream=True)
        wrk_stream = wrk(url, args.seconds, stream=True)
    print(f"{'':<28}{'ftctl load (open loop)':>26}{'wrk (closed, 32 conns)':>26}{'ratio':>8}")
    print(f"{'non-streaming requests/s':<28}{plain['req_s']:>26,.0f}{wrk_plain:>26,.0f}"
          f"{plain['req_s'] / wrk_plain:>8.2f}")
    print(f"{'streamed tokens/s':<28}{streamed['tok_s']:>26,.0f}{wrk_stream * 64:>26,.0f}"
          f"{streamed['tok_s'] / (wrk_stream * 64):>8.2f}")
    print(f"  (lag p99 at those rates: {plain['lag_p99_ms']:.3f} ms and "
          f"{streamed['lag_p99_ms']:.3f} ms)")
    print("== 2. TTFT overhead: ftctl load's TTFT (from send) minus the server's own, p50")
    client, server, diff, n = overhead_on_sim(max(args.seconds * 4, 10.0))
    print(f" ftctl sim (64-token prompt, 5 req/s, {n} streams): client {client:.3f} ms, "
          f"server {server:.3f} ms, overhead {client - server:+.3f} ms "
          f"(per-request difference p50 {diff:+.3f} ms; goal <= 1 ms)")
    client, server = overhead_on_target(args.seconds)
    print(f" loopback target (5 ms to first token): client {client:.3f} ms, "
          f"server {server:.3f} ms, overhead {client - server:+.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
