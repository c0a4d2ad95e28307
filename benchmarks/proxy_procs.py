"""Issue 25: `ftctl proxy --procs N` across cores (goal: >= 1.8x the req/s of --procs 1 on
2 cores, non-streamed).

Same run, interleaved rounds: the proxy with `--procs 1` and `--procs 2` in front of the
trivial upstream of benchmarks/proxy.py (an asyncio protocol + httptools), loaded by
`wrk` (C, one thread, 32 connections, non-streamed 16-token requests). Nothing is
pinned: on a 2-core machine the proxy's processes, the upstream and wrk share both
cores, so req/s alone says how the whole box did, not how the proxy scales. The
script also reads the CPU time of every proxy process (/proc: the serving children
of `--procs 2`, the parent is idle), the upstream's and wrk's, and prints each one's
CPU-milliseconds per 1,000 requests. From those it prints the ceiling this machine
puts on `--procs 2`: all its cores divided by the CPU that one request costs the
proxy, the upstream and wrk together; the 1.8x goal is out of reach wherever that
ceiling is below 1.8x the `--procs 1` figure. If the proxy's CPU per request stays
flat from 1 to 2 processes, its work spreads without overhead, and on two cores of
its own (client and upstream elsewhere) it would serve about twice as many.

Usage: python benchmarks/proxy_procs.py [--rounds R] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

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


def children_cpu() -> float:
    """CPU seconds of this process's collected children (wrk, once it has ended)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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


class Round(NamedTuple):
    """One round: req/s, and CPU-seconds per 1,000 requests of each process."""

    rps: float
    cores: float  # CPUs the three kept busy on average (the rest: others on the machine)
    proxy: float
    upstream: float
    client: float


def measure(upstream: subprocess.Popen[bytes], upstream_url: str, procs: int, *,
            seconds: int, directory: Path, script: Path) -> Round:
    """One round on a fresh proxy."""
    proc, port = start_proxy(upstream_url, procs, directory)
    try:
        url = f"http://127.0.0.1:{port}"
        wrk(url, 1, script)  # warm-up: connections, pools, the first scrapes
        pids = family(proc.pid)
        if len(pids) != procs + (procs > 1):
            raise SystemExit(f"--procs {procs}: {len(pids)} processes")
        cpu0, up0, wrk0 = cpu_seconds(pids), cpu_seconds([upstream.pid]), children_cpu()
        rps, count = wrk(url, seconds, script)
        per_k = 1000 / count
        proxy_s = cpu_seconds(pids) - cpu0
        upstream_s = cpu_seconds([upstream.pid]) - up0
        client_s = children_cpu() - wrk0
        return Round(rps, (proxy_s + upstream_s + client_s) * rps / count, proxy_s * per_k,
                     upstream_s * per_k, client_s * per_k)
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
    results: dict[int, list[Round]] = {1: [], 2: []}
    try:
        wait_up(port, upstream)
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            script = directory / "post.lua"
            script.write_text(f"wrk.method = \"POST\"\nwrk.body = '{BODY}'\n"
                              'wrk.headers["Content-Type"] = "application/json"\n')
            for _ in range(args.rounds):  # interleaved: the machine's noise hits both
                for procs in (1, 2):
                    results[procs].append(measure(
                        upstream, f"http://127.0.0.1:{port}", procs, seconds=args.seconds,
                        directory=directory, script=script))
    finally:
        stop(upstream)
    print(f"benchmarks/proxy_procs.py: {os.cpu_count()} CPUs shared by the proxy, the trivial "
          f"upstream and wrk (-t1 -c{CONNECTIONS}), non-streamed 16-token requests, "
          f"{args.rounds} interleaved rounds of {args.seconds} s")
    print("CPU-ms per 1,000 requests (medians):")
    print(f"{'--procs':>8} {'req/s median':>13} {'range':>17} {'proxy':>7} {'upstream':>9} "
          f"{'wrk':>5} {'CPUs used':>10}")
    medians = {}
    for procs, rows in results.items():
        rps = [r.rps for r in rows]
        medians[procs] = Round(*(statistics.median(col) for col in zip(*rows, strict=True)))
        m = medians[procs]
        print(f"{procs:>8} {m.rps:>13,.0f} {min(rps):>8,.0f}-{max(rps):<8,.0f} "
              f"{m.proxy * 1000:>7,.0f} {m.upstream * 1000:>9,.0f} {m.client * 1000:>5,.0f} "
              f"{m.cores:>10.2f}")
    one, two = medians[1], medians[2]
    scaling = two.rps / one.rps
    ceiling = len(os.sched_getaffinity(0)) * 1000 / (two.proxy + two.upstream + two.client)
    verdict = "MET" if scaling >= 1.8 else "NOT MET"
    print(f"scaling --procs 2 / --procs 1: {scaling:.2f}x (goal >= 1.8x: {verdict}); proxy "
          f"CPU per request {two.proxy / one.proxy:.2f}x that of one process")
    print(f"ceiling for --procs 2 if every core here went to proxy, upstream and wrk: "
          f"{ceiling:,.0f} req/s = {ceiling / one.rps:.2f}x the --procs 1 figure ('CPUs used' "
          "below the machine's count: other work on it took the rest)")


if __name__ == "__main__":
    main()
