"""Cache-aware routing on real vLLM: prefix-cache hit rate and TTFT, against least-outstanding.

Two vLLM 0.32.0 servers (CPU, the suite's tiny random-weight Llama, prefix caching on,
one core each) behind, in turn and in the same run:

- `ftctl proxy --routing least_outstanding` (the default),
- `ftctl proxy --routing cache_aware` (sglang-router's thresholds),
- `vllm-router --policy cache_aware` 0.1.17 (PyPI), when it installs: its venv is
  ~/.cache/ftctl/vllm-router-0.1.17 when another run finished it there (its `.installed`
  marker), else this script installs it into ~/.cache/ftctl/vllm-router-0.1.17-cache-aware
  (its own folder, its own marker: two installs never share a folder).

Each arm gets the same multi-turn workload, `ftctl load --chat --conversations N --turns
K` (closed loop, --users U, streamed, --ignore-eos), with a seed of its own: the servers'
caches keep what earlier arms left, and conversations of another seed share none of it.
Per arm it prints the servers' prefix-cache hit rate over the arm (tokens, the deltas of
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` summed over both),
the share of those tokens the first server got (the load split), and the client's TTFT
p50 and p99 (ms). Arms go in a rotated order each round. First it prints the proxy's
CPU per routing choice, cache-aware against least-outstanding, in this process
(`--cost-only`: that alone).

Needs the vLLM venv (`make vllm`, or $FTCTL_VLLM_PYTHON); without it this prints a note
and exits 0. Usage: python benchmarks/cache_aware.py [--conversations 8] [--turns 5]
[--users 4] [--rounds 1] [--no-router] [--cost-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from tests.integration.vllm.server import (  # noqa: E402
    VllmServer,
    spawn_vllm,
    tiny_llama_dir,
    vllm_python,
    wait_healthy,
)

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftctl"
ROUTER = "vllm-router==0.1.17"
ARMS = ("least_outstanding", "cache_aware", "vllm-router cache_aware")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def router_venv() -> Path | str:
    """vllm-router's venv, or why there is none (one line)."""
    shared = CACHE / "vllm-router-0.1.17"
    if (shared / ".installed").exists() and (shared / "bin" / "vllm-router").exists():
        return shared
    own = CACHE / "vllm-router-0.1.17-cache-aware"
    if (own / ".installed").exists():
        return own
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(own)], check=True,
                       capture_output=True, timeout=300)
        subprocess.run([str(own / "bin" / "pip"), "install", "-q", ROUTER], check=True,
                       capture_output=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"pip install {ROUTER} failed: {str(exc).splitlines()[0]}"
    (own / ".installed").touch()
    return own


def wait_serving(url: str, proc: subprocess.Popen[bytes], log: Path, path: str) -> None:
    """Until GET url+path answers 200 (a condition with a 60 s deadline)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    msg = f"{url} did not start:\n{log.read_text(errors='replace')[-2000:]}"
    raise SystemExit(msg)


@contextmanager
def front(arm: str, servers: list[VllmServer], folder: Path,
          venv: Path | None) -> Iterator[str]:
    """The arm's front door over `servers`: its URL while it runs."""
    log = folder / f"{arm.replace(' ', '-')}.log"
    if arm.startswith("vllm-router"):
        assert venv is not None
        port = free_port()
        argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--policy", "cache_aware", "--worker-urls", *(s.url for s in servers)]
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, proc, log, "/health")
    else:
        inventory = folder / f"{arm}.yaml"
        workers = "".join(f"  - {{name: {s.name}, url: '{s.url}', model: {s.model}}}\n"
                          for s in servers)
        inventory.write_text(f"cluster: bench-cache-aware\nworkers:\n{workers}proxy:\n"
                             f"  listen: 127.0.0.1:0\n  routing: {arm}\n"
                             "  breaker_threshold: 100000\n")
        with log.open("wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory),
                                     "proxy"], stdout=subprocess.DEVNULL, stderr=sink)
        end = time.monotonic() + 60
        url = ""
        while not url and time.monotonic() < end and proc.poll() is None:
            found = re.search(r"serving \d+ workers on (http://\S+)", log.read_text())
            url = found.group(1) if found else ""
            time.sleep(0.05)
        if not url:
            proc.kill()
            msg = f"the proxy did not start:\n{log.read_text()[-2000:]}"
            raise SystemExit(msg)
        wait_serving(url, proc, log, "/health")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def counters(server: VllmServer) -> tuple[float, float]:
    """(prefix-cache hits, queries) in tokens."""
    page = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = []
    for name in ("hits", "queries"):
        values = re.findall(rf"^vllm:prefix_cache_{name}_total(?:{{[^}}]*}})? (\S+)$", page,
                            re.MULTILINE)
        out.append(sum(float(v) for v in values))
    return out[0], out[1]


def run_arm(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One multi-turn load through `url`: its TTFT p50/p99 (ms) and failures."""
    requests = args.conversations * args.turns
    argv = [sys.executable, "-m", "dynamo_ftctl", "load", "--url", url, "--model", model,
            "--chat", "--conversations", str(args.conversations), "--turns", str(args.turns),
            "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
            "--ignore-eos", "--stream", "--users", str(args.users), "--requests", str(requests),
            "--seed", str(seed), "--timeout", "120s", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False)
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        msg = f"ftctl load failed ({done.returncode}):\n{done.stderr[-2000:]}"
        raise SystemExit(msg) from None
    summary = doc.get("summary", doc)
    ttft = summary["ttft_ms"]
    return {"p50": ttft["p50"], "p99": ttft["p99"], "completed": summary["completed"],
            "failed": summary["failed"]}


def choice_cost() -> None:
    """CPU per routing choice in this process: cache-aware (key a chat, choose, record)
    against least-outstanding `pick`, over four workers, by the system prompt's length."""
    import timeit

    from dynamo_ftctl.inventory.proxy import CacheAware
    from dynamo_ftctl.proxy.balancer import Balancer, WorkerSlot
    from dynamo_ftctl.proxy.ledger import StreamLedger
    from dynamo_ftctl.proxy.prefix import prefix_key

    def slots() -> list[WorkerSlot]:
        return [WorkerSlot(name=f"w{i}", url="x", group=f"g{i}", model="m") for i in range(4)]

    aware, plain = Balancer(slots(), cache_aware=CacheAware()), Balancer(slots())
    print("| system prompt (characters) | least_outstanding pick (us) | cache_aware (us) |")
    print("|---|---|---|")
    for size in (500, 4000, 16000):
        ledger = StreamLedger("chat", {"model": "m", "messages": [
            {"role": "system", "content": "x" * size}, {"role": "user", "content": "hi"}]})

        def choose(ledger: StreamLedger = ledger) -> None:
            aware.pick_by_prefix(prefix_key(ledger, "m"), model="m")

        runs = 2000
        cached = min(timeit.repeat(choose, number=runs, repeat=5)) / runs
        least = min(timeit.repeat(lambda: plain.pick(model="m"), number=runs, repeat=5)) / runs
        print(f"| {size} | {least * 1e6:.1f} | {cached * 1e6:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument("--cost-only", action="store_true",
                        help="only the CPU per routing choice (no vLLM)")
    args = parser.parse_args()
    choice_cost()
    if args.cost_only:
        return 0
    python = vllm_python()
    if not python.exists():
        print(f"benchmarks/cache_aware.py: no vLLM venv at {python} (make vllm): skipped")
        return 0
    arms = list(ARMS[:2])
    venv: Path | None = None
    if not args.no_router:
        found = router_venv()
        if isinstance(found, str):
            print(f"note: vllm-router left out: {found}")
        else:
            venv = found
            arms.append(ARMS[2])
    model_dir = tiny_llama_dir(python)
    results: dict[str, list[tuple[float, float, float, dict[str, float]]]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="ftctl-bench-cache-aware-") as tmp:
        folder = Path(tmp)
        cpus = sorted(os.sched_getaffinity(0))
        servers = [spawn_vllm(python, model_dir, folder / f"vllm{i}.log", name=f"vllm{i}",
                              cpu=cpus[i % len(cpus)], extra_args=("--enable-prefix-caching",))
                   for i in range(2)]
        try:
            began = time.monotonic()
            for server in servers:
                wait_healthy(server, began)
            seed = 100
            for round_ in range(args.rounds):
                order = arms[round_ % len(arms):] + arms[:round_ % len(arms)]
                for arm in order:
                    seed += 1
                    with front(arm, servers, folder, venv) as url:
                        before = [counters(s) for s in servers]
                        ttft = run_arm(url, servers[0].model, args, seed)
                        after = [counters(s) for s in servers]
                    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
                    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
                    total = sum(queries) or 1.0
                    results[arm].append((hits / total, queries[0] / total, total, ttft))
                    print(f"round {round_ + 1} {arm}: hit rate {hits / total:.3f}, "
                          f"TTFT p50 {ttft['p50']:.1f} ms p99 {ttft['p99']:.1f} ms, "
                          f"first server's share {queries[0] / total:.2f}, "
                          f"{ttft['completed']:.0f} done, {ttft['failed']:.0f} failed",
                          flush=True)
        finally:
            for server in servers:
                server.stop()
    print()
    print(f"{args.conversations} conversations x {args.turns} turns, {args.users} users, "
          f"prompt {args.prompt_tokens} + reply {args.max_tokens} tokens a turn, "
          f"{args.rounds} round(s); medians over rounds")
    print("| routing | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) "
          "| first server's share |")
    print("|---|---|---|---|---|")
    for arm, rows in results.items():
        med = statistics.median
        print(f"| {arm} | {med([r[0] for r in rows]):.3f} | "
              f"{med([r[3]['p50'] for r in rows]):.1f} | {med([r[3]['p99'] for r in rows]):.1f} | "
              f"{med([r[1] for r in rows]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
