"""Canary figures (issue 6): one-shot probe wall time, daemon fan-out, detection latency.

1. One-shot probe: median wall time of `ftctl canary --url ... --set
   canaries/ftctl-sim-tiny.yaml --no-state` (a whole process: interpreter,
   CLI, set validation, 3 prompts x 8 tokens) against a healthy local `ftctl
   sim` worker, interleaved with the same-run baselines `python -c pass`,
   `ftctl --version` and `ftctl inventory check` (a full-CLI command that reads
   and validates a YAML file). Goal: <= 150 ms.
2. Daemon fan-out: a fleet of 1,000 lightweight fake endpoints in one process
   (pinned to CPU 1) answering the golden tokens; `HealthDaemon.probe_round`
   with its real aiohttp transport in this process (pinned to CPU 0): wall and
   CPU time of one round (3 prompts per worker = 3,000 requests). Goal <= 5 s.
3. Detection latency on real sim workers and a real `ftctl canary --watch`
   process: SIGKILL -> UNHEALTHY (a) with the proxy's passive report sent right
   after the kill (goal <= 100 ms), (b) by probes alone (goal <= interval +
   timeout), timed from the kill to the transition's own timestamp.

`same, no lean start/exit` is the fast path run through `entry.main()` rather
than the console script's `entry.console()`: garbage collector on, msgspec
importing typing_extensions, interpreter teardown at exit. `same, full CLI` is
the probe with the console script's fast path off (FTCTL_NO_FAST_PATH=1: typer
and click parse the arguments). `--one-shot` runs part 1 only. The machine is
shared and noisy: run this two or three times and quote medians.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "canaries" / "ftctl-sim-tiny.yaml"
FTCTL = [sys.executable, "-m", "dynamo_ftctl"]
BIN_FTCTL = str(Path(sys.executable).parent / "ftctl")
RUNS = 15
FLEET = 1000
# An installed ftctl runs from byte code; PYTHONDONTWRITEBYTECODE in the caller's
# environment would make each run compile the sources again (see benchmarks/startup.py).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        os.sched_setaffinity(0, {cpu})


# ---------------------------------------------------------------------------
# 1. one-shot probe


def _wall(argv: list[str], ok: tuple[int, ...] = (0,)) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False,
                          env=ENV)
    elapsed = time.perf_counter() - start
    if proc.returncode not in ok:
        msg = f"{argv} exited {proc.returncode}: {proc.stderr.decode()[-300:]}"
        raise SystemExit(msg)
    return elapsed


# The fast path through `main()`, as the console script ran it before `console()`:
# with the garbage collector on, msgspec importing typing_extensions, and the
# interpreter torn down at exit.
_PLAIN_MAIN = "import sys; from dynamo_ftctl.cli.entry import main; sys.exit(main())"


def one_shot(url: str) -> None:
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "ftctl --version": [BIN_FTCTL, "--version"],
        "ftctl inventory check": [BIN_FTCTL, "inventory", "check",
                                  str(ROOT / "examples" / "local.yaml")],
        "ftctl canary (1 worker)": [BIN_FTCTL, "canary", "--url", url, "--set", str(SET),
                                    "--no-state"],
        "same, no lean start/exit": [sys.executable, "-c", _PLAIN_MAIN, "canary", "--url", url,
                                     "--set", str(SET), "--no-state"],
        "same, full CLI": ["env", "FTCTL_NO_FAST_PATH=1", BIN_FTCTL, "canary", "--url", url,
                           "--set", str(SET), "--no-state"],
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for argv in cases.values():
        _wall(argv)
    for _ in range(RUNS):
        for name, argv in cases.items():
            samples[name].append(_wall(argv))
    base = statistics.median(samples["python -c pass"])
    print(f"\n1. one-shot probe vs a healthy sim worker (median of {RUNS}, interleaved)")
    print(f"   {'command':<26}{'median ms':>10}{'vs python':>11}")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"   {name:<26}{med * 1000:>10.1f}{med / base:>10.1f}x")
    probe = statistics.median(samples["ftctl canary (1 worker)"])
    plain = statistics.median(samples["same, no lean start/exit"])
    verdict = "met" if probe <= 0.150 else "MISSED"
    print(f"   goal <= 150 ms: {verdict} ({probe * 1000:.0f} ms; {(plain - probe) * 1000:.0f} ms "
          f"less than through entry.main(), {probe / plain:.2f}x)")
    # In-process: the probe's own time without interpreter and CLI start-up.
    from dynamo_ftctl.health.canaryset import load_canary_set
    from dynamo_ftctl.health.probe import ProbeTarget, probe_worker
    from dynamo_ftctl.inventory import CanaryConfig

    canary_set = load_canary_set(SET)
    own = [probe_worker(ProbeTarget("w", url), canary_set, CanaryConfig()).wall_s
           for _ in range(RUNS)]
    print(f"   probe itself, in process (3 prompts x 8 tokens): "
          f"{statistics.median(own) * 1000:.1f} ms median")


# ---------------------------------------------------------------------------
# 2. daemon fan-out over a fake fleet


def _golden_responses() -> dict[str, bytes]:
    from dynamo_ftctl.health.canaryset import load_canary_set

    out = {}
    for p in load_canary_set(SET).prompts:
        ids = list(p.expected_token_ids or ())
        top = sum(p.expected_top_logprob_range) / 2 if p.expected_top_logprob_range else -0.5
        body = json.dumps({"id": "x", "object": "text_completion", "choices": [{
            "index": 0, "text": p.expected_text, "token_ids": ids, "finish_reason": "length",
            "logprobs": {"tokens": ["t"] * len(ids), "token_logprobs": [top] * len(ids),
                         "top_logprobs": [{"t": top}] * len(ids)}}]}).encode()
        out[p.prompt] = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return out


def run_fleet(count: int) -> None:
    """The fake fleet: `count` listeners in one asyncio process; prints their ports."""
    _pin(1)
    answers = _golden_responses()
    length = re.compile(rb"(?i)content-length:\s*(\d+)")

    class Endpoint(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while True:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                match = length.search(self.buf[:end])
                size = int(match.group(1)) if match else 0
                if len(self.buf) < end + 4 + size:
                    return
                body = self.buf[end + 4:end + 4 + size]
                self.buf = self.buf[end + 4 + size:]
                self.transport.write(answers[json.loads(body)["prompt"]])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(Endpoint, "127.0.0.1", 0) for _ in range(count)]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        sys.stdout.write(json.dumps(ports) + "\n")
        sys.stdout.flush()
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin

    asyncio.run(main())


def fan_out() -> None:
    from dynamo_ftctl.health.canaryset import load_canary_set
    from dynamo_ftctl.health.daemon import HealthDaemon, WatchedWorker
    from dynamo_ftctl.health.probe import ProbeTarget
    from dynamo_ftctl.inventory import CanaryConfig

    fleet = subprocess.Popen([sys.executable, __file__, "--fleet", str(FLEET)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert fleet.stdout is not None
        ports = json.loads(fleet.stdout.readline())
        _pin(0)
        config = CanaryConfig(interval_s=30, timeout_s=10)
        workers = [WatchedWorker(ProbeTarget(f"f{i}", f"http://127.0.0.1:{p}", "ftctl-sim-tiny"))
                   for i, p in enumerate(ports)]

        async def rounds() -> list[tuple[float, float, int]]:
            daemon = HealthDaemon(workers, load_canary_set(SET), config)
            out = []
            try:
                for _ in range(4):
                    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
                    start = time.perf_counter()
                    await daemon.probe_round()
                    wall = time.perf_counter() - start
                    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
                    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
                    healthy = daemon.counts()["healthy"]
                    kinds = sorted({e.last.reason for e in daemon.entries.values()
                                    if e.last is not None and not e.last.healthy})
                    if kinds:
                        print(f"   (failures in this round, e.g. {kinds[0]!r})")
                    out.append((wall, cpu, healthy))
            finally:
                await daemon.aclose()
            return out

        results = asyncio.run(rounds())
    finally:
        if fleet.stdin is not None:
            fleet.stdin.close()
        fleet.wait(timeout=10)
    print(f"\n2. daemon: one round over {FLEET} fake endpoints (3 prompts each = "
          f"{FLEET * 3} requests), daemon pinned to one core, concurrency "
          f"{config.concurrency}")
    for index, (wall, cpu, healthy) in enumerate(results, start=1):
        note = " (opens connections)" if index == 1 else ""
        print(f"   round {index}: {wall:.2f} s wall, {cpu:.2f} s CPU, "
              f"{healthy}/{FLEET} healthy{note}")
    steady = statistics.median(w for w, _, _ in results[1:])
    cpu = statistics.median(c for _, c, _ in results[1:])
    print(f"   goal <= 5 s: {'met' if steady <= 5 else 'MISSED'} ({steady:.2f} s median of "
          f"rounds 2-4); CPU per interval {cpu:.2f} s = {cpu / config.interval_s * 100:.1f}% "
          f"of a core at interval_s {config.interval_s:g}")


# ---------------------------------------------------------------------------
# 3. detection latency


def detection() -> None:
    from dynamo_ftctl.engine.launcher import start_worker

    interval, timeout = 2.0, 1.0
    with tempfile.TemporaryDirectory() as tmp:
        workers = [start_worker(f"w{i}", admin_token="bench", timeout_s=120) for i in range(4)]
        inventory = {
            "cluster": "bench",
            "workers": [{"name": w.name, "url": w.url, "model": "ftctl-sim-tiny"}
                        for w in workers],
            "canary": {"interval_s": interval, "timeout_s": timeout, "max_retries": 0,
                       "set": str(SET), "state_file": f"{tmp}/state.json"},
        }
        inv = Path(tmp) / "inv.yaml"
        inv.write_text(json.dumps(inventory))
        daemon = subprocess.Popen([*FTCTL, "-i", str(inv), "canary", "--watch", "--json",
                                   "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "FTCTL_DAEMON_TOKEN": "bench"})
        unhealthy_at: dict[str, float] = {}
        seen = threading.Event()

        def read() -> None:
            assert daemon.stdout is not None
            for line in daemon.stdout:
                record = json.loads(line)
                if record.get("event") == "transition" and record["state"] == "unhealthy":
                    unhealthy_at[record["worker"]] = record["ts"]
                    seen.set()

        try:
            url = _daemon_url(daemon)
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            import httpx

            # The proxy reports over a connection it keeps open (its pooled client):
            # one client, connected before the kill. A fresh `httpx.post` per report
            # would add ~50 ms of client set-up (an SSL context) to every figure.
            reporter = httpx.Client(timeout=5, headers={"Authorization": "Bearer bench"})
            reporter.get(f"{url}/health")
            time.sleep(interval * 1.5)  # a first round has probed everyone
            passive, probes, exits = [], [], []
            for worker in workers[:2]:
                seen.clear()
                died: list[float] = []
                waiter = threading.Thread(
                    target=lambda w=worker, d=died: (w.proc.wait(), d.append(time.time())))
                waiter.start()
                killed = time.time()
                worker.kill()
                reporter.post(f"{url}/report", json={"worker": worker.name, "ok": False,
                                                     "reason": "stream broke",
                                                     "source": "proxy"})
                seen.wait(10)
                waiter.join(10)
                passive.append(unhealthy_at[worker.name] - killed)
                exits.append(died[0] - killed)
            for index, worker in enumerate(workers[2:]):
                time.sleep(0.7 * (index + 1))  # a different phase of the interval each time
                seen.clear()
                killed = time.time()
                worker.kill()
                seen.wait(interval + 10 * timeout)
                probes.append(unhealthy_at[worker.name] - killed)
            reporter.close()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
            for worker in workers:
                worker.stop(timeout_s=3)
    print(f"\n3. detection latency, SIGKILL -> UNHEALTHY (real sim workers, interval "
          f"{interval:g} s, timeout {timeout:g} s, failure_threshold 3)")
    print("   via passive report: " + ", ".join(f"{v * 1000:.0f} ms" for v in passive)
          + f"; goal <= 100 ms: {'met' if max(passive) <= 0.1 else 'MISSED'}")
    print("   (of which SIGKILL -> process gone, the kernel tearing down the engine's memory "
          "before its socket closes: " + ", ".join(f"{v * 1000:.0f} ms" for v in exits) + ")")
    print("   via probes alone:   " + ", ".join(f"{v:.2f} s" for v in probes)
          + f"; goal <= interval + timeout = {interval + timeout:g} s: "
          + ("met" if max(probes) <= interval + timeout else "MISSED"))


def _daemon_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if selector.select(timeout=0.2):
            line = proc.stderr.readline()
            if "serving" in line:
                return line.strip().rsplit(" ", 1)[-1]
        if proc.poll() is not None:
            break
    msg = "the canary daemon did not start"
    raise SystemExit(msg)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--fleet":
        run_fleet(int(sys.argv[2]))
        return 0
    from dynamo_ftctl.engine.launcher import start_worker

    worker = start_worker("bench", timeout_s=120)
    try:
        one_shot(worker.url)
    finally:
        worker.stop(timeout_s=3)
    if sys.argv[1:] == ["--one-shot"]:
        return 0
    fan_out()
    detection()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
