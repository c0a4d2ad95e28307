"""Figures of issue 22 (admission): how soon the proxy sheds once a worker saturates.

One `ftctl sim` worker behind `ftctl proxy` (both from this tree, or from
`--baseline-src DIR` too, in the same run). The worker's capacity is measured
first (a closed loop straight to it), then an open loop offers `--overload`
times that rate through the proxy. Meanwhile the benchmark polls the worker's
own `/metrics` every `--poll-ms` (its ground truth, not the proxy's view) and
notes the first instant the worker is over the proxy's busy thresholds:
*saturation*. The figure is the time from saturation to the first 503 the
proxy answers (by the send time of that request). Goal: <= 100 ms.

Two workloads, each saturating the worker through one of the two busy signals:

- `queue`: short requests on an engine with 8 sequence slots; the engine's
  waiting queue grows, and the worker is over `active_prefill_tokens_threshold`
  (here 8 waiting prompts) first;
- `kv`: long generations on a small KV pool; the running requests' blocks grow
  token by token past `active_decode_blocks_threshold` (0.85).

The proxy keeps its default scrape interval (1 s) unless `--scrape-interval-s`.
Issue 22 saw the first shed 2.1 s into a 3x overload. The machine is shared:
read the median of `--runs`.

    python benchmarks/admission.py [--signal queue|kv|both] [--runs 3] [--baseline-src DIR]

(DIR: another source tree, e.g. `git archive REV src | tar -x -C DIR`.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dynamo_ftctl.engine.launcher import SimWorker, start_worker
from proxy import free_port, stop, wait_http  # benchmarks/proxy.py

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MODEL = "ftctl-sim-tiny"
PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    """An engine shape, a request shape and the thresholds that make it saturate."""

    name: str
    engine: dict[str, int]
    max_tokens: int
    kv_threshold: float
    prefill_threshold: int

    def busy(self, kv_usage: float, waiting: float) -> bool:
        """The proxy's busy rule applied to the worker's own figures."""
        return kv_usage > self.kv_threshold or waiting * PROMPT_TOKENS > self.prefill_threshold


WORKLOADS = {
    "queue": Workload("queue", {"max_num_seqs": 8, "num_blocks": 1024}, max_tokens=32,
                      kv_threshold=0.85, prefill_threshold=8 * PROMPT_TOKENS),
    # 32 + 96 tokens = 8 blocks a request: 8 fill the pool, 64 slots never limit.
    "kv": Workload("kv", {"max_num_seqs": 64, "num_blocks": 64}, max_tokens=96,
                   kv_threshold=0.85, prefill_threshold=10**8),
}


def _env(src: Path | None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str((src or ROOT) / "src")}


def start_sim(folder: Path, load: Workload, src: Path | None) -> SimWorker:
    """`ftctl sim serve` with the workload's engine shape."""
    config = folder / f"engine-{load.name}.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in load.engine.items()))
    return start_worker(load.name, model_config=str(config), env=_env(src),
                        args=("--served-model-name", MODEL, "--warmup-s", "0"))


def start_proxy(folder: Path, worker_url: str, load: Workload, scrape_s: float | None,
                src: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    """`ftctl proxy` in front of one worker with the workload's thresholds; (process, URL)."""
    port = free_port()
    inventory = folder / f"inventory-{port}.yaml"
    scrape = f"  scrape_interval_s: {scrape_s}\n" if scrape_s else ""
    inventory.write_text(
        f"cluster: bench\nworkers:\n  - {{name: w0, url: '{worker_url}', model: {MODEL}}}\n"
        f"proxy:\n  listen: 127.0.0.1:{port}\n{scrape}"
        f"  busy: {{active_decode_blocks_threshold: {load.kv_threshold}, "
        f"active_prefill_tokens_threshold: {load.prefill_threshold}}}\n")
    proc = subprocess.Popen([PY, "-m", "dynamo_ftctl", "-i", str(inventory), "proxy"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(src))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 60.0)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def body(load: Workload) -> dict[str, Any]:
    return {"model": MODEL, "prompt": list(range(65, 65 + PROMPT_TOKENS)),
            "max_tokens": load.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}


async def capacity(session: aiohttp.ClientSession, url: str, load: Workload,
                   seconds: float) -> float:
    """Completed requests per second of a closed loop that keeps the worker full."""
    slots = load.engine["max_num_seqs"] if load.name == "queue" else 16
    done = 0
    end = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < end:
            async with session.post(f"{url}/v1/completions", json=body(load)) as resp:
                await resp.read()
                done += resp.status == 200

    start = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(2 * slots)))
    return done / (time.monotonic() - start)


async def poll_worker(session: aiohttp.ClientSession, url: str, load: Workload, *,
                      every_s: float, stop: asyncio.Event, t0: float) -> float | None:
    """Seconds after `t0` at which the worker's own metrics first show it busy (None: never)."""
    pattern = re.compile(rb"^(vllm:kv_cache_usage_perc|vllm:num_requests_waiting)\{[^}]*\} (\S+)",
                         re.MULTILINE)
    while not stop.is_set():
        stamp = time.monotonic()
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.read()
        values = {m.group(1): float(m.group(2)) for m in pattern.finditer(text)}
        if load.busy(values.get(b"vllm:kv_cache_usage_perc", 0.0),
                     values.get(b"vllm:num_requests_waiting", 0.0)):
            return stamp - t0
        await asyncio.sleep(every_s)
    return None


@dataclass(frozen=True)
class Run:
    """One overload run: seconds from the load's start."""

    capacity: float
    saturated_at: float | None
    first_shed_at: float | None
    shed: int
    shed_early: int  # 503s sent before the worker was saturated
    served: int

    @property
    def delay_ms(self) -> float | None:
        if self.saturated_at is None or self.first_shed_at is None:
            return None
        return (self.first_shed_at - self.saturated_at) * 1e3


async def overload(proxy_url: str, worker_url: str, load: Workload, *, rate: float,
                   seconds: float, poll_s: float) -> tuple[float | None, list[tuple[float, int]]]:
    """Offer `rate` requests/s through the proxy for `seconds`; (saturation, [(sent, status)])."""
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sent: list[tuple[float, int]] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        poller = asyncio.create_task(poll_worker(session, worker_url, load, every_s=poll_s,
                                                 stop=stop, t0=t0))

        async def one(at: float) -> None:
            async with session.post(f"{proxy_url}/v1/completions", json=body(load)) as resp:
                await resp.read()
                sent.append((at, resp.status))

        tasks = []
        count = int(rate * seconds)
        for i in range(count):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(time.monotonic() - t0)))
        await asyncio.wait({poller, asyncio.ensure_future(asyncio.gather(*tasks))},
                           return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        saturated = await poller
        await asyncio.gather(*tasks)
    return saturated, sent


async def one_run(folder: Path, load: Workload, args: argparse.Namespace,
                  src: Path | None) -> Run:
    worker = start_sim(folder, load, src)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            rate = await capacity(session, worker.url, load, args.capacity_s)
        proxy, proxy_url = start_proxy(folder, worker.url, load, args.scrape_interval_s, src)
        try:
            await asyncio.sleep(1.5)  # a scrape or two of the idle worker
            saturated, sent = await overload(proxy_url, worker.url, load,
                                             rate=args.overload * rate, seconds=args.seconds,
                                             poll_s=args.poll_ms / 1e3)
        finally:
            stop(proxy)
    finally:
        worker.stop()
    shed = sorted(at for at, status in sent if status == 503)
    return Run(capacity=rate, saturated_at=saturated, first_shed_at=shed[0] if shed else None,
               shed=len(shed), served=sum(status == 200 for _, status in sent),
               shed_early=sum(at < saturated for at in shed) if saturated is not None else 0)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, unit: str) -> str:
    return "never" if value is None else f"{value:.0f} {unit}"


def _ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else seconds * 1e3, "ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signal", choices=["queue", "kv", "both"], default="both")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--overload", type=float, default=3.0, help="times the capacity")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of the overload")
    parser.add_argument("--capacity-s", type=float, default=4.0)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--scrape-interval-s", type=float, default=None)
    parser.add_argument("--baseline-src", type=Path, metavar="DIR")
    args = parser.parse_args()
    names = ["queue", "kv"] if args.signal == "both" else [args.signal]
    trees: dict[str, Path | None] = {"this tree": None}
    if args.baseline_src is not None:
        trees["baseline"] = args.baseline_src
    failed = False
    with tempfile.TemporaryDirectory(prefix="ftctl-bench-admission-") as tmp:
        for name in names:
            load = WORKLOADS[name]
            for label, src in trees.items():
                runs = []
                for index in range(args.runs):
                    run = asyncio.run(one_run(Path(tmp), load, args, src))
                    runs.append(run)
                    print(f"{name} {label} run {index + 1}: capacity {run.capacity:.1f} req/s, "
                          f"saturated at {_ms(run.saturated_at)}, first 503 at "
                          f"{_ms(run.first_shed_at)}, {run.shed} shed ({run.shed_early} before "
                          f"saturation), {run.served} served", file=sys.stderr)
                delay = _median([r.delay_ms for r in runs])
                print(f"{name:5} {label:9}: saturation -> first 503, median of {args.runs}: "
                      f"{_fmt(delay, 'ms')} (goal <= 100 ms); capacity "
                      f"{_median([r.capacity for r in runs]):.1f} req/s, offered "
                      f"{args.overload:g}x; shed before saturation: "
                      f"{_median([float(r.shed_early) for r in runs]):.0f}")
                if src is None and (delay is None or delay > 100):
                    failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
