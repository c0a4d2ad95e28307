"""How closely the TCP fault proxy's toxics keep their figures on loopback (`make bench`).

The suite's tests (tests/integration/faults/test_netproxy.py) hold what the proxy
guarantees on any machine: a delay never shorter than the toxic's, a rate never above
it. This script measures how close it stays to the target, on this machine, now:

1. latency 25 ms: the median round trip with the toxic less the median without
   (goal: 25 ms ± 2 ms);
2. latency 20 ± 10 ms: the range of the added delay (goal: within 10-30 ms + 2 ms);
3. bandwidth 256 KiB/s: the rate of 320 KiB from first to last byte (goal: ± 10%).

Usage: python benchmarks/netproxy.py [--rounds N] (prints each figure, its goal, MET or
NOT MET, and the load average; exit 0 either way).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The suite's echo upstream and round-trip timer, so that both measure the same thing.
from tests.integration.faults.test_netproxy import _echo, _rtts

from dynamo_ftctl.faults.netproxy import NetProxy, Toxic


def _quiet_cancelled(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """Python 3.11's stream callback reads `task.exception()` of a handler task that
    asyncio.run cancelled at its end, and logs the CancelledError; anything else is shown."""
    if not isinstance(context.get("exception"), asyncio.CancelledError):
        loop.default_exception_handler(context)


async def _with_proxy(handler: object, toxic: Toxic | None, work: object) -> object:
    asyncio.get_running_loop().set_exception_handler(_quiet_cancelled)
    upstream = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    proxy = await NetProxy("127.0.0.1", upstream.sockets[0].getsockname()[1], seed=1).start()
    try:
        if toxic is not None:
            proxy.add_toxic(toxic)
        return await work(proxy.port)  # type: ignore[operator]
    finally:
        await proxy.stop()
        upstream.close()


async def latency_added_ms() -> float:
    base = await _with_proxy(_echo, None, lambda port: _rtts(port, 50))
    slow = await _with_proxy(_echo, Toxic("lat", "latency", latency_ms=25),
                             lambda port: _rtts(port, 50))
    return (statistics.median(slow) - statistics.median(base)) * 1e3  # type: ignore[arg-type]


async def jitter_range_ms() -> tuple[float, float]:
    base = statistics.median(await _with_proxy(_echo, None, lambda port: _rtts(port, 50)))  # type: ignore[arg-type]
    rtts = await _with_proxy(_echo, Toxic("lat", "latency", latency_ms=20, jitter_ms=10),
                             lambda port: _rtts(port, 80))
    added = [(r - base) * 1e3 for r in rtts]  # type: ignore[attr-defined]
    return min(added), max(added)


async def bandwidth_kib_s() -> float:
    size = 320 * 1024

    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(b"x" * size)
        await writer.drain()
        writer.close()

    async def fetch(port: int) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"g")
        await writer.drain()
        await reader.read(65536)
        start = time.perf_counter()
        rest = await reader.read(-1)
        elapsed = time.perf_counter() - start
        writer.close()
        return len(rest) / 1024 / elapsed

    return await _with_proxy(send, Toxic("bw", "bandwidth", rate_kbps=256), fetch)  # type: ignore[return-value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    added, lows, highs, rates = [], [], [], []
    for _ in range(args.rounds):
        added.append(asyncio.run(latency_added_ms()))
        low, high = asyncio.run(jitter_range_ms())
        lows.append(low)
        highs.append(high)
        rates.append(asyncio.run(bandwidth_kib_s()))
    lat, rate = statistics.median(added), statistics.median(rates)
    low, high = statistics.median(lows), statistics.median(highs)
    rows = [
        ("latency 25 ms: added (median)", f"{lat:.2f} ms", "25 ± 2 ms", abs(lat - 25) <= 2),
        ("latency 20 ± 10 ms: added range", f"{low:.1f}-{high:.1f} ms", "10-32 ms",
         low >= 9 and high <= 32),
        ("bandwidth 256 KiB/s", f"{rate:.1f} KiB/s", "230-282 KiB/s", abs(rate - 256) <= 25.6),
    ]
    print(f"TCP fault proxy accuracy, medians of {args.rounds} rounds "
          f"(load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for name, value, goal, met in rows:
        print(f"  {name:34} {value:>14}   goal {goal:14} {'MET' if met else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
