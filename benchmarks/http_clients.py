"""Which HTTP client lets one core generate the most load? httpx vs aiohttp vs wrk.

The loopback target (`dynamo_ftctl.loadgen.target`, raw asyncio) runs pinned
to CPU 0 and every client to CPU 1, so client CPU is the limit. Each client
runs a closed loop of 32 keep-alive connections for a few seconds against
`POST /v1/completions` (non-streaming, 16 tokens). `wrk` (C) is the ceiling.
HTTP/2 for httpx needs the `h2` package and a server that offers h2c; neither
is installed here, so only HTTP/1.1 pools are compared.

Run: .venv/bin/python benchmarks/http_clients.py [--seconds 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

BODY = b'{"model":"m","prompt":"hello","max_tokens":16}'
CONNECTIONS = 32


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() else []


@contextmanager
def target(*extra: str) -> Iterator[str]:
    """Start the loopback target on CPU 0; yield its base URL."""
    proc = subprocess.Popen(
        [*_pin(0), sys.executable, "-m", "dynamo_ftctl.loadgen.target", "--port", "0", *extra],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the target prints its address once listening
        match = re.search(r"listening on (\S+):(\d+)", line)
        if not match:
            raise RuntimeError(f"target did not start: {line!r}")
        yield f"http://{match.group(1)}:{match.group(2)}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def _closed_loop(send: Callable[[], Awaitable[None]], seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def user() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await send()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(CONNECTIONS)))
    return done / (time.perf_counter() - start)


async def bench_aiohttp(url: str, seconds: float) -> float:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def send() -> None:
            async with session.post(url + "/v1/completions", data=BODY,
                                    headers={"content-type": "application/json"}) as resp:
                await resp.read()
        return await _closed_loop(send, seconds)


async def bench_httpx(url: str, seconds: float, connections: int = CONNECTIONS) -> float:
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits) as client:
        async def send() -> None:
            resp = await client.post(url + "/v1/completions", content=BODY,
                                     headers={"content-type": "application/json"})
            resp.read()
        return await _closed_loop(send, seconds)


def bench_wrk(url: str, seconds: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = '{BODY.decode()}'\n"
            'wrk.headers["Content-Type"] = "application/json"\n')
        out = subprocess.run(
            [*_pin(1), "wrk", "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s",
             "-s", str(script), url + "/v1/completions"],
            capture_output=True, text=True, check=True, timeout=seconds + 30).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return float(match.group(1))


def _in_cpu1(coro_factory: Callable[[], Awaitable[float]]) -> float:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    return asyncio.run(coro_factory())  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    with target() as url:
        for _ in range(args.runs):
            clients: dict[str, Callable[[], float]] = {
                "wrk (C, ceiling)": lambda: bench_wrk(url, args.seconds),
                "aiohttp ClientSession": lambda: _in_cpu1(
                    lambda: bench_aiohttp(url, args.seconds)),
                "httpx AsyncClient": lambda: _in_cpu1(lambda: bench_httpx(url, args.seconds)),
                "httpx AsyncClient (1 conn)": lambda: _in_cpu1(
                    lambda: bench_httpx(url, args.seconds, connections=1)),
            }
            for name, run in clients.items():
                results.setdefault(name, []).append(run())
    base = statistics.median(results["aiohttp ClientSession"])
    print(f"closed loop, {CONNECTIONS} keep-alive connections, median of {args.runs} runs "
          f"of {args.seconds:g} s (target on CPU 0, client on CPU 1)")
    print(f"{'client':<28} {'req/s (median)':>15} {'runs':>28} {'vs aiohttp':>11}")
    for name, values in results.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<28} {med:>15,.0f} {runs:>28} {med / base:>10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
