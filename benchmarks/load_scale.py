"""Does `ftctl load` keep up with wrk on one core, and scale with `--procs`?

Three closed loops of 32 connections, non-streamed 16-token answers, interleaved and
repeated (median and range of `--repeat`, default 3, `--seconds` each):

1. One process against the loopback target (`dynamo_ftctl.loadgen.target`, pinned to
   CPU 0; client pinned to CPU 1): `ftctl load --users 32` vs `wrk -t1 -c32` in the same
   run (goal: >= 0.5x wrk's requests/s).
2. `ftctl load --procs 1` vs `--procs 2` against nginx (`return 200` of a fixed answer,
   2 workers), every process free on both cores (goal: >= 1.8x). On a 2-core machine the
   server shares the cores with the generator, so the raw ratio cannot reach 2; the
   ratio of requests per generator CPU-second says whether a second process costs
   anything per request, and the CPU the generator got says how much of the machine it
   had. Generator CPU is its processes' user + system time (RUSAGE_CHILDREN) over the
   whole command (interpreter start, the run, the merge), per wall second of it.

The planned schedule itself (one plan shared out, exact merged percentiles) is tested
in tests/; this measures speed only. Run: python benchmarks/load_scale.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# This folder, on sys.path as a script's: the loopback target (pinned to CPU 0) and wrk
# (pinned to CPU 1, the same 16-token request) of load.py.
from load import target as loopback_target
from load import wrk as _wrk

ANSWER = ('{"id":"x","object":"text_completion","model":"m","choices":[{"index":0,'
          '"text":"aaaaaaaaaaaaaaaa","finish_reason":"length"}],'
          '"usage":{"prompt_tokens":16,"completion_tokens":16,"total_tokens":32}}')


def _pin(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if shutil.which("taskset") else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def nginx() -> Iterator[str]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as tmp:
        port = _free_port()
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(f"""daemon off; worker_processes 2; pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
events {{ worker_connections 1024; }}
http {{ access_log off; client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/f; uwsgi_temp_path {tmp}/u; scgi_temp_path {tmp}/s;
  keepalive_requests 1000000;
  server {{ listen 127.0.0.1:{port}; location / {{ default_type application/json;
    return 200 '{ANSWER}'; }} }} }}
""")
        proc = subprocess.Popen([binary, "-c", str(conf), "-p", tmp],
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not _accepts(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {proc.returncode}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def ftctl_load(url: str, seconds: float, *, procs: int, cpus: str) -> tuple[float, float]:
    """(requests/s in the run's window, generator CPU-seconds per wall second of the whole
    command: start-up, the run, and merging the shares' samples)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    out = subprocess.run(
        [*_pin(cpus), sys.executable, "-m", "dynamo_ftctl", "load", "--url", url,
         "--users", "32", "--duration", f"{seconds}s", "--max-tokens", "16",
         "--prompt-tokens", "16", "--model", "m", "--procs", str(procs), "--json"],
        capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    doc = json.loads(out)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return doc["requests_per_s"], cpu / wall


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):>9,.0f}  ({min(values):,.0f}-{max(values):,.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk is not installed (make debs)")
        return 1
    ours: list[float] = []
    theirs: list[float] = []
    with loopback_target() as url:
        for _ in range(args.repeat):
            theirs.append(_wrk(url, args.seconds, stream=False))
            ours.append(ftctl_load(url, args.seconds, procs=1, cpus="1")[0])
    ratio = statistics.median(o / t for o, t in zip(ours, theirs, strict=True))
    print("== 1. one process vs wrk: closed loop, 32 connections, loopback target on CPU 0,")
    print("      client on CPU 1, non-streamed 16 tokens (requests/s, median (range))")
    print(f"  wrk -t1 -c32                {_fmt(theirs)}")
    print(f"  ftctl load --users 32       {_fmt(ours)}")
    print(f"  ratio {ratio:.2f} (goal >= 0.5): {'MET' if ratio >= 0.5 else 'NOT MET'}")
    if not (shutil.which("nginx") or Path("/usr/sbin/nginx").exists()):
        print("== 2. skipped: nginx is not installed (apt-get install nginx)")
        return 0
    rows: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    with nginx() as url:
        for _ in range(args.repeat):
            for procs in (1, 2):
                rows[procs].append(ftctl_load(url, args.seconds, procs=procs, cpus="0,1"))
    print("== 2. --procs 1 vs 2: closed loop, 32 users, nginx (2 workers) on the same 2 cores")
    print(f"  {'':<12}{'requests/s':>24}{'generator CPUs':>16}{'req per CPU-s':>16}")
    per_cpu: dict[int, list[float]] = {}
    for procs, got in rows.items():
        per_cpu[procs] = [r / c for r, c in got]
        print(f"  --procs {procs:<4}{_fmt([r for r, _ in got]):>24}"
              f"{statistics.median(c for _, c in got):>16.2f}"
              f"{statistics.median(per_cpu[procs]):>16,.0f}")
    scale = statistics.median(b[0] / a[0] for a, b in zip(rows[1], rows[2], strict=True))
    efficiency = statistics.median(b / a for a, b in zip(per_cpu[1], per_cpu[2], strict=True))
    print(f"  requests/s ratio {scale:.2f} (goal >= 1.8): {'MET' if scale >= 1.8 else 'NOT MET'}"
          f"; requests per generator CPU-second ratio {efficiency:.2f} (1.0: a second "
          "process costs nothing per request)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
