"""Issue 25: `ftctl proxy` on one core against nginx as a plain reverse proxy (`make bench`).

Both proxies forward to the same trivial upstream (`dynamo_ftctl.loadgen.target`, raw
asyncio streams) and are pinned to CPU 0; the upstream and the client (`wrk`, one
thread, 32 connections) share the other core. nginx runs from a generated config
in a temporary directory, in the foreground (`daemon off; master_process off`: one
process, the one measured), one worker, upstream keep-alive, `proxy_buffering off`
(each upstream read is written on at once, as an SSE relay must). `ftctl proxy`
has an inventory of one worker, the target.

Two loads: non-streamed requests of 16 tokens, streamed requests of 64 tokens. For
each: wrk's requests/s and each proxy's CPU time over the run (utime + stime from
/proc/PID/stat), so that CPU per request decides and not the client's shared core.
Runs alternate (nginx, proxy, baseline proxy) `--repeat` times; medians and ranges.

Goals: non-streamed req/s >= 0.5x nginx's; streamed tokens per proxy CPU-second
>= nginx's.

Usage: python benchmarks/proxy_nginx.py [--seconds S] [--repeat N] [--baseline-src DIR]
(DIR: another source tree, e.g. `git archive REV src | tar -x -C DIR`, whose proxy is
measured beside this one in the same run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from proxy import cpu_seconds, free_port, stop  # benchmarks/proxy.py

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CPUS = sorted(os.sched_getaffinity(0))
PROXY_CPU = CPUS[0]
CLIENT_CPU = CPUS[-1]
CONNECTIONS = 32
LOADS = {"non-streamed": (16, False), "streamed": (64, True)}

_NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log error;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream target {{ server 127.0.0.1:{upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://target;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def wait_http(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 20.0) -> None:
    """Wait until `url` answers (any status), or fail when `proc` dies or time is up."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            msg = f"{proc.args!r} exited with {proc.returncode} before {url} answered"
            raise SystemExit(msg)
        try:
            urllib.request.urlopen(url, timeout=0.5).close()
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
        else:
            return
    msg = f"{url} did not come up in {deadline_s} s"
    raise SystemExit(msg)


def pinned(cpu: int, args: list[str], env: dict[str, str] | None = None,
           **kwargs: object) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(args, cwd=ROOT, env=env, **kwargs)  # type: ignore[call-overload]
    os.sched_setaffinity(proc.pid, {cpu})
    return proc  # type: ignore[no-any-return]


@contextlib.contextmanager
def running(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        stop(*procs)


def start_target() -> tuple[subprocess.Popen[bytes], int]:
    proc = pinned(CLIENT_CPU, [PY, "-m", "dynamo_ftctl.loadgen.target", "--port", "0"],
                  env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                  stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    match = re.search(r":(\d+)\s*$", line)
    if match is None:
        proc.kill()
        msg = f"the target said {line!r}, not its port"
        raise SystemExit(msg)
    return proc, int(match.group(1))


def start_nginx(directory: Path, upstream: int) -> tuple[subprocess.Popen[bytes], str]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    port = free_port()
    conf = directory / "nginx.conf"
    conf.write_text(_NGINX_CONF.format(dir=directory, upstream=upstream, port=port))
    proc = pinned(PROXY_CPU, [nginx, "-p", str(directory), "-c", str(conf)])
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    return proc, url


def start_proxy(directory: Path, upstream: int, src: Path,
                whole_max_tokens: int = 0) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    inv = directory / f"inv-{port}.yaml"
    inv.write_text(f"cluster: bench\nworkers:\n  - {{name: w0, url: 'http://127.0.0.1:"
                   f"{upstream}', model: m}}\nproxy:\n  listen: 127.0.0.1:{port}\n"
                   "  busy: {active_prefill_tokens_threshold: 100000000}\n"
                   f"  whole_max_tokens: {whole_max_tokens}\n")
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    proc = pinned(PROXY_CPU, [PY, "-m", "dynamo_ftctl", "-i", str(inv), "proxy"], env=env,
                  stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    return proc, url


class Run(NamedTuple):
    """One wrk run through one proxy."""

    rps: float
    cpu_s: float  # the proxy's CPU time over the run
    requests: int
    # Requests wrk gave up on after its 2 s timeout (a starved machine); any other
    # socket error or a non-2xx answer fails the run.
    timeouts: int = 0

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / max(self.requests, 1) * 1e6


def wrk(url: str, pid: int, directory: Path, seconds: float, *, tokens: int,
        stream: bool, cpu_of: Callable[[int], float] = cpu_seconds) -> Run:
    """One wrk run against `url`; `cpu_of(pid)` is the CPU time counted (the process's
    own by default)."""
    script = directory / f"post-{tokens}-{stream}.lua"
    body = (f'{{"model":"m","prompt":"hi","max_tokens":{tokens},'
            f'"stream":{str(stream).lower()}}}')
    script.write_text(f"wrk.method = \"POST\"\nwrk.body = '{body}'\n"
                      'wrk.headers["Content-Type"] = "application/json"\n')
    cpu0 = cpu_of(pid)
    out = subprocess.run(["taskset", "-c", str(CLIENT_CPU), "wrk", "-t1",
                          f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s",
                          "-s", str(script), f"{url}/v1/completions"],
                         capture_output=True, text=True, check=True, timeout=seconds + 30)
    cpu = cpu_of(pid) - cpu0
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    total = re.search(r"(\d+) requests in", out.stdout)
    if rps is None or total is None:
        msg = f"wrk said:\n{out.stdout}{out.stderr}"
        raise SystemExit(msg)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), "
                        r"timeout (\d+)", out.stdout)
    if "Non-2xx" in out.stdout or (sockets is not None and any(
            int(n) for n in sockets.groups()[:3])):
        msg = f"errors through {url}:\n{out.stdout}"
        raise SystemExit(msg)
    timeouts = int(sockets.group(4)) if sockets is not None else 0
    return Run(float(rps.group(1)), cpu, int(total.group(1)), timeouts)


def spread(values: list[float], fmt: str = ",.0f") -> str:
    """Median and range."""
    return (f"{statistics.median(values):{fmt}} "
            f"({min(values):{fmt}}-{max(values):{fmt}})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="each wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each proxy per load")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="another source tree whose proxy runs beside this one")
    args = parser.parse_args()
    if shutil.which("wrk") is None or not (shutil.which("nginx") or
                                           Path("/usr/sbin/nginx").exists()):
        msg = "needs wrk and nginx (make debs)"
        raise SystemExit(msg)
    if len(CPUS) < 2:
        print(f"note: one CPU ({CPUS}): proxy and client share it")
    with tempfile.TemporaryDirectory(prefix="ftctl-nginx-") as tmp:
        directory = Path(tmp)
        target, upstream = start_target()
        with running(target):
            labels = ["nginx", "proxy"]
            procs = [start_nginx(directory, upstream), start_proxy(directory, upstream, ROOT)]
            if args.baseline_src is not None:
                labels.append("baseline proxy")
                procs.append(start_proxy(directory, upstream, args.baseline_src.resolve()))
            with running(*(p for p, _ in procs)):
                results = measure(labels, procs, directory, args)
        report(labels, results)


def measure(labels: list[str], procs: list[tuple[subprocess.Popen[bytes], str]],
            directory: Path, args: argparse.Namespace) -> dict[tuple[str, str], list[Run]]:
    results: dict[tuple[str, str], list[Run]] = {}
    for load, (tokens, stream) in LOADS.items():
        for (proc, url) in procs:  # warm-up: connections, caches, the first requests
            wrk(url, proc.pid, directory, 1, tokens=tokens, stream=stream)
        for _ in range(args.repeat):
            for label, (proc, url) in zip(labels, procs, strict=True):
                results.setdefault((label, load), []).append(
                    wrk(url, proc.pid, directory, args.seconds, tokens=tokens,
                        stream=stream))
    return results


def report(labels: list[str], results: dict[tuple[str, str], list[Run]]) -> None:
    print(f"one core each (CPU {PROXY_CPU}), wrk + target on CPU {CLIENT_CPU}, "
          f"{CONNECTIONS} connections; median (range) of {len(results[labels[0], 'non-streamed'])}"
          " runs")
    print(f"{'proxy':<16}{'load':<14}{'req/s':>24}{'CPU us/req':>22}{'tokens/CPU-s':>26}")
    for load, (tokens, _) in LOADS.items():
        for label in labels:
            runs = results[label, load]
            per_cpu = [r.requests * tokens / r.cpu_s for r in runs if r.cpu_s]
            print(f"{label:<16}{load:<14}{spread([r.rps for r in runs]):>24}"
                  f"{spread([r.cpu_us_per_request for r in runs]):>22}"
                  f"{spread(per_cpu):>26}")
    for label in labels[1:]:
        plain = (statistics.median(r.rps for r in results[label, "non-streamed"])
                 / statistics.median(r.rps for r in results["nginx", "non-streamed"]))
        ours = statistics.median(r.requests * 64 / r.cpu_s for r in results[label, "streamed"])
        theirs = statistics.median(r.requests * 64 / r.cpu_s
                                   for r in results["nginx", "streamed"])
        print(f"{label}: non-streamed req/s {plain:.2f}x nginx (goal >= 0.5: "
              f"{'MET' if plain >= 0.5 else 'NOT MET'}); streamed tokens per CPU-second "
              f"{ours / theirs:.2f}x nginx (goal >= 1: "
              f"{'MET' if ours >= theirs else 'NOT MET'})")


if __name__ == "__main__":
    main()
