"""Which HTTP client lets one core generate the most load? ftctl's http1 vs aiohttp vs httpx vs wrk.

The loopback target (`dynamo_ftctl.loadgen.target`, raw asyncio) runs pinned
to CPU 0 and every client to CPU 1, so client CPU is the limit. Each client
runs a closed loop of 32 keep-alive connections for a few seconds against
`POST /v1/completions` (non-streaming, 16 tokens; with --stream, 64 streamed
tokens, read to the end). `wrk` (C) is the ceiling. `ftctl http1` is the load
generator's default client (`loadgen.sender`: asyncio protocols + httptools);
both it and aiohttp also run on uvloop, as `ftctl load` runs them.
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
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BODY = b'{"model":"m","prompt":"hello","max_tokens":16}'
STREAM_BODY = b'{"model":"m","prompt":"hello","max_tokens":64,"stream":true}'
CONNECTIONS = 32
HEADERS = {"content-type": "application/json"}


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


async def bench_aiohttp(url: str, seconds: float, body: bytes) -> float:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def send() -> None:
            async with session.post(url + "/v1/completions", data=body,
                                    headers=HEADERS) as resp:
                await resp.read()
        return await _closed_loop(send, seconds)


async def bench_http1(url: str, seconds: float, body: bytes) -> float:
    from dynamo_ftctl.loadgen.sender import Http1Sender

    sender = Http1Sender(timeout_s=30, now=time.monotonic)
    target = url + "/v1/completions"

    async def send() -> None:
        ex = await sender.exchange("POST", target, body, HEADERS)
        if ex.outcome != "ok":
            raise RuntimeError(ex.error)

    try:
        return await _closed_loop(send, seconds)
    finally:
        sender.close()


async def bench_httpx(url: str, seconds: float, body: bytes,
                      connections: int = CONNECTIONS) -> float:
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits) as client:
        async def send() -> None:
            resp = await client.post(url + "/v1/completions", content=body, headers=HEADERS)
            resp.read()
        return await _closed_loop(send, seconds)


def bench_wrk(url: str, seconds: float, body: bytes) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = '{body.decode()}'\n"
            'wrk.headers["Content-Type"] = "application/json"\n')
        out = subprocess.run(
            [*_pin(1), "wrk", "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s",
             "-s", str(script), url + "/v1/completions"],
            capture_output=True, text=True, check=True, timeout=seconds + 30).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return float(match.group(1))


def _in_cpu1(coro_factory: Callable[[], Coroutine[Any, Any, float]], *,
             uvloop: bool = False) -> float:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    if uvloop:
        from dynamo_ftctl.loadgen.runner import run_in_fast_loop

        return run_in_fast_loop(coro_factory())
    return asyncio.run(coro_factory())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stream", action="store_true",
                        help="64 streamed tokens per request instead of a 16-token body")
    parser.add_argument("--no-httpx", action="store_true", help="leave out httpx (slow)")
    args = parser.parse_args()
    body = STREAM_BODY if args.stream else BODY
    secs = args.seconds
    results: dict[str, list[float]] = {}
    with target() as url:
        clients: dict[str, Callable[[], float]] = {
            "wrk (C, ceiling)": lambda: bench_wrk(url, secs, body),
            "aiohttp ClientSession": lambda: _in_cpu1(lambda: bench_aiohttp(url, secs, body)),
            "aiohttp on uvloop": lambda: _in_cpu1(lambda: bench_aiohttp(url, secs, body),
                                                  uvloop=True),
            "ftctl http1": lambda: _in_cpu1(lambda: bench_http1(url, secs, body)),
            "ftctl http1 on uvloop": lambda: _in_cpu1(lambda: bench_http1(url, secs, body),
                                                      uvloop=True),
        }
        if not args.no_httpx:
            clients["httpx AsyncClient"] = lambda: _in_cpu1(
                lambda: bench_httpx(url, secs, body))
            clients["httpx AsyncClient (1 conn)"] = lambda: _in_cpu1(
                lambda: bench_httpx(url, secs, body, connections=1))
        for _ in range(args.runs):  # interleaved, so load from others hits every client
            for name, run in clients.items():
                results.setdefault(name, []).append(run())
    base = statistics.median(results["aiohttp ClientSession"])
    what = "64 streamed tokens" if args.stream else "16 tokens, not streamed"
    print(f"closed loop, {CONNECTIONS} keep-alive connections, {what}, median of {args.runs} "
          f"runs of {secs:g} s (target on CPU 0, client on CPU 1)")
    print(f"{'client':<28} {'req/s (median)':>15} {'runs':>28} {'vs aiohttp':>11}")
    for name, values in results.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<28} {med:>15,.0f} {runs:>28} {med / base:>10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
