"""Kernel-log Xid watcher: parser throughput and follow latency (issue 7).

1. Throughput on a 1,000,000-line kernel log with 1% Xid lines (the rest is
   ordinary dmesg noise), median of 5 runs each:
   - the parser alone (`KmsgParser.parse_lines` over the open file),
   - the watcher (parser + PCI map + catalog + `GpuEvent` records),
   - the whole command, `ftctl gpu kmsg --source FILE --json > /dev/null`
     (process start and 10,000 JSON lines included).
   Goal: >= 500,000 lines/s.
2. Follow latency: `ftctl gpu kmsg --source FILE --follow --json` runs in the
   background; one Xid line at a time is appended to the file and the time
   until its JSON event is read from the command's stdout is measured
   (default --poll-interval 10 ms). Goal: <= 50 ms.

Run: .venv/bin/python benchmarks/xid.py [--lines 1000000] [--samples 200]
"""

from __future__ import annotations

import argparse
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.gpu.kmsg import KmsgParser, KmsgWatcher

FTCTL = shutil.which("ftctl", path=str(Path(sys.executable).parent)) or "ftctl"
PCI_MAP = {"0000:18:00": 0, "0000:3b:00": 1, "0000:86:00": 2, "0000:af:00": 3}

NOISE = [
    "[{t:12.6f}] usb 1-1: new high-speed USB device number 3 using xhci_hcd",
    "[{t:12.6f}] EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode. Opts: (null)",
    "[{t:12.6f}] IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "[{t:12.6f}] nvidia-uvm: Loaded the UVM driver, major device number 509.",
    "[{t:12.6f}] NVRM: GPU at PCI:0000:3b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae",
    "[{t:12.6f}] audit: type=1400 audit({t:.3f}:42): apparmor=\"STATUS\" operation=\"open\"",
    "[{t:12.6f}] perf: interrupt took too long (2503 > 2500), lowering kernel.perf_event_max",
]
XIDS = [
    "[{t:12.6f}] NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=vllm, An uncorrectable double "
    "bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
    "[{t:12.6f}] NVRM: Xid (PCI:0000:86:00): 94, pid=77, name=python3, Contained: SM (0x1). "
    "RST: No, D-RST: No",
    "[{t:12.6f}] NVRM: NVRM: Xid (PCI:0000:af:00): 13, pid=5, name=app, Graphics SM Warp "
    "Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
    "[{t:12.6f}] NVRM: Xid (0000:18:00): 31, Ch 0000000b, engmask 00000120, intr 10000000",
    "[{t:12.6f}] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
    "off the bus.",
]


def write_log(path: Path, lines: int, xid_share: float = 0.01) -> int:
    """A synthetic kernel log; returns the number of Xid lines in it."""
    rng = random.Random(7)
    every = round(1 / xid_share)
    xids = 0
    with path.open("w") as out:
        for i in range(lines):
            t = i * 0.001
            if i % every == every - 1:
                out.write(XIDS[rng.randrange(len(XIDS))].format(t=t) + "\n")
                xids += 1
            else:
                out.write(NOISE[rng.randrange(len(NOISE))].format(t=t) + "\n")
    return xids


def median_seconds(run: object, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_parser(log: Path, lines: int, xids: int) -> None:
    def parse_only() -> None:
        parser = KmsgParser()
        with log.open(encoding="utf-8", errors="replace") as handle:
            found = sum(1 for _ in parser.parse_lines(handle))
        assert found == xids, (found, xids)

    def watcher() -> None:
        w = KmsgWatcher(node="node-a", clock=FakeClock(), pci_map=PCI_MAP)
        with log.open(encoding="utf-8", errors="replace") as handle:
            found = sum(1 for _ in w.events(handle))
        assert found == xids

    spec = ",".join(f"{bus}={index}" for bus, index in PCI_MAP.items())

    def command() -> None:
        proc = subprocess.run(
            [FTCTL, "gpu", "kmsg", "--source", str(log), "--json", "--pci-map", spec],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
        )
        assert proc.returncode == 1, proc.stderr  # actionable Xids found

    size_mb = log.stat().st_size / 1e6
    print(f"log: {lines:,} lines, {xids:,} Xid lines ({xids / lines:.1%}), {size_mb:.0f} MB")
    for name, fn, repeat in (
        ("parser (KmsgParser.parse_lines)", parse_only, 5),
        ("watcher (parser + catalog + GpuEvent)", watcher, 5),
        ("command (ftctl gpu kmsg --json > /dev/null)", command, 3),
    ):
        seconds = median_seconds(fn, repeat)
        print(f"  {name:46s} {seconds:6.3f} s  {lines / seconds:>12,.0f} lines/s")


def bench_follow(directory: Path, samples: int) -> None:
    log = directory / "follow.log"
    log.write_text("[    0.000000] boot\n")
    spec = ",".join(f"{bus}={index}" for bus, index in PCI_MAP.items())
    proc = subprocess.Popen(
        [FTCTL, "gpu", "kmsg", "--source", str(log), "--follow", "--json", "--pci-map", spec],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
    )
    assert proc.stdout is not None
    latencies: list[float] = []
    rng = random.Random(11)
    try:
        buffered = b""
        for i in range(samples + 5):  # the first 5 warm the process up
            line = XIDS[i % len(XIDS)].format(t=float(i)) + "\n"
            with log.open("a") as out:
                start = time.perf_counter()
                out.write(line)
            while b"\n" not in buffered:
                ready, _, _ = select.select([proc.stdout], [], [], 10.0)
                if not ready:
                    raise RuntimeError("no event within 10 s")
                buffered += os.read(proc.stdout.fileno(), 65536)
            elapsed = time.perf_counter() - start
            _, buffered = buffered.split(b"\n", 1)
            if i >= 5:
                latencies.append(elapsed * 1000)
            # Lines arrive at random moments, so latency samples the whole poll period.
            time.sleep(rng.uniform(0.0, 0.02))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    latencies.sort()
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    print(
        f"follow latency (line appended → JSON event), {len(latencies)} samples, "
        f"--poll-interval 10 ms: median {statistics.median(latencies):.1f} ms, "
        f"p95 {p95:.1f} ms, max {latencies[-1]:.1f} ms"
    )


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--lines", type=int, default=1_000_000)
    args.add_argument("--samples", type=int, default=200)
    opts = args.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftctl-xid-bench-") as tmp:
        log = Path(tmp) / "kern.log"
        xids = write_log(log, opts.lines)
        bench_parser(log, opts.lines, xids)
        bench_follow(Path(tmp), opts.samples)


if __name__ == "__main__":
    main()
