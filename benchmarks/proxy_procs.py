"""Issue 25: `ftctl proxy --procs N` across cores (goal: >= 1.8x the req/s of --procs 1 on
2 cores, non-streamed).

Same run, interleaved rounds: the proxy with `--procs 1` and `--procs 2` in front of the
trivial upstream of benchmarks/proxy.py (an asyncio protocol + httptools), loaded by
`wrk` (C, one thread, 32 connections, non-streamed 16-token requests). Nothing is
pinned: on a 2-core machine the proxy's processes, the upstream and wrk share both
cores, so req/s alone says how the whole box did, not how the proxy scales. The
script also reads the CPU time of every proxy process (/proc: the serving children
of `--procs 2`, the parent is idle) and prints the proxy's CPU-seconds per 1,000
requests: if it stays flat from 1 to 2 processes, the proxy's work spreads without
overhead, and its req/s on two cores of its own would be about twice that of one.

Usage: python benchmarks/proxy_procs.py [--rounds R] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BODY = '{"model": "m", "prompt": "hi", "max_tokens": 16, "temperature": 0}'
CONNECTIONS = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_up(port: int, proc: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"process {proc.args} ended with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"port {port} did not open in {deadline_s} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def start_proxy(upstream: str, procs: int, directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    inv = directory / f"inv-{port}.yaml"
    inv.write_text(f"cluster: bench\nworkers:\n  - {{name: w0, url: '{upstream}', model: m}}\n"
                   f"proxy:\n  listen: 127.0.0.1:{port}\n  procs: {procs}\n"
                   "  busy: {active_prefill_tokens_threshold: 100000000}\n")
    proc = subprocess.Popen([PY, "-m", "dynamo_ftctl", "-i", str(inv), "proxy"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(port, proc)
    return proc, port


def family(pid: int) -> list[int]:
    """`pid` and its children (the serving processes of `--procs N`)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *map(int, children)]


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def wrk(url: str, seconds: int, script: Path) -> tuple[float, int]:
    """(requests/s, requests) of a wrk run; exits when a response was not 2xx."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds}s", "-s", str(script),
         f"{url}/v1/completions"], capture_output=True, text=True, check=True,
        timeout=seconds + 30).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    count = re.search(r"(\d+) requests in", out)
    if rps is None or count is None:
        raise SystemExit(f"unexpected wrk output:\n{out}")
    return float(rps.group(1)), int(count.group(1))


def measure(upstream: str, procs: int, seconds: int, directory: Path,
            script: Path) -> tuple[float, float]:
    """(req/s, proxy CPU-seconds per 1,000 requests) of one round on a fresh proxy."""
    proc, port = start_proxy(upstream, procs, directory)
    try:
        url = f"http://127.0.0.1:{port}"
        wrk(url, 1, script)  # warm-up: connections, pools, the first scrapes
        pids = family(proc.pid)
        if len(pids) != procs + (procs > 1):
            raise SystemExit(f"--procs {procs}: {len(pids)} processes")
        cpu0 = cpu_seconds(pids)
        rps, count = wrk(url, seconds, script)
        return rps, (cpu_seconds(pids) - cpu0) / count * 1000
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    upstream = subprocess.Popen([PY, str(ROOT / "benchmarks" / "proxy.py"), "upstream",
                                 str(port), "0", "0", str(10**9)], cwd=ROOT,
                                stdout=subprocess.DEVNULL)
    results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    try:
        wait_up(port, upstream)
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            script = directory / "post.lua"
            script.write_text(f"wrk.method = \"POST\"\nwrk.body = '{BODY}'\n"
                              'wrk.headers["Content-Type"] = "application/json"\n')
            for _ in range(args.rounds):  # interleaved: the machine's noise hits both
                for procs in (1, 2):
                    results[procs].append(measure(f"http://127.0.0.1:{port}", procs,
                                                  args.seconds, directory, script))
    finally:
        stop(upstream)
    print(f"benchmarks/proxy_procs.py: {os.cpu_count()} CPUs shared by the proxy, the trivial "
          f"upstream and wrk (-t1 -c{CONNECTIONS}), non-streamed 16-token requests, "
          f"{args.rounds} interleaved rounds of {args.seconds} s")
    print(f"{'--procs':>8} {'req/s median':>13} {'range':>17} {'proxy CPU-ms/1k req':>20}")
    medians = {}
    for procs, rows in results.items():
        rps = [r for r, _ in rows]
        cost = statistics.median(c for _, c in rows)
        medians[procs] = (statistics.median(rps), cost)
        print(f"{procs:>8} {medians[procs][0]:>13,.0f} {min(rps):>8,.0f}-{max(rps):<8,.0f} "
              f"{cost * 1000:>20,.0f}")
    scaling = medians[2][0] / medians[1][0]
    cost_ratio = medians[2][1] / medians[1][1]
    verdict = "MET" if scaling >= 1.8 else "NOT MET"
    print(f"scaling --procs 2 / --procs 1: {scaling:.2f}x (goal >= 1.8x: {verdict}); proxy "
          f"CPU per request {cost_ratio:.2f}x that of one process")


if __name__ == "__main__":
    main()
