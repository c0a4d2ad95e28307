"""Issue #22's eight attacks, issue #29's judgment attacks and issue #30's hostile files,
replayed on loopback against real ftctl processes.

`make chaos` runs this (and `make bench` with the other scripts). Each attack starts what
it needs (`ftctl sim` engines, `ftctl proxy`, the canary daemon, `ftctl lock`), attacks it
as the issue describes, and prints one row: attack, what must happen, what happened.
The exit status is 1 when any row misses its expectation, so a regression shows here as in
the tests. Every process is stopped and every temporary file removed at the end; every
wait is a condition with a deadline, every loop bounded.

Usage: python benchmarks/chaos.py [--only N[,N...]] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MODEL = "ftctl-sim-tiny"
SIM_TOKEN = "chaos-sim-token"
PROXY_TOKEN = "chaos-proxy-token"
DAEMON_TOKEN = "chaos-daemon-token"

import httpx  # noqa: E402

sys.path.insert(0, str(ROOT))  # the proxy tests' helpers, as benchmarks/vllm.py does
from tests.integration.proxy.test_proxy_admission import cut_stream  # noqa: E402
from tests.integration.proxy.test_proxy_judgment import stand_in  # noqa: E402
from tests.integration.proxy.test_proxy_sim import gauge  # noqa: E402

from dynamo_ftctl.engine.launcher import SimWorker, start_worker  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One attack's outcome."""

    attack: str
    expected: str
    observed: str
    ok: bool


# ------------------------------------------------------------------ processes on loopback


def wait_until(check: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Poll `check` until it holds; RuntimeError naming `what` past the deadline."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            msg = f"timed out waiting for {what}"
            raise RuntimeError(msg)
        time.sleep(0.01)


def ftctl(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 30.0,
          ) -> tuple[int, str, str, float, float]:
    """Run `ftctl ARGV`: exit code, stdout, stderr, wall seconds, its peak RSS in MiB.

    A run past `timeout_s` is killed (exit code -9).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen([PY, "-m", "dynamo_ftctl", *argv], stdout=out, stderr=err,
                                env={**os.environ, **(env or {})})
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # wait4: this child's own rusage
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return (proc.returncode, out.read().decode(errors="replace"),
                err.read().decode(errors="replace"), wall, usage.ru_maxrss / 1024)


@contextlib.contextmanager
def sims(count: int, *args: str) -> Iterator[list[SimWorker]]:
    """`count` sim engines on free ports (no warm-up, the admin token set); stopped after."""
    workers: list[SimWorker] = []
    try:
        for i in range(count):
            workers.append(start_worker(f"w{i + 1}", admin_token=SIM_TOKEN, timeout_s=90,
                                        args=("--warmup-s", "0", *args)))
        yield workers
    finally:
        for worker in workers:
            worker.stop(timeout_s=3)


def write_inventory(folder: Path, workers: list[SimWorker], **proxy: Any) -> Path:
    """An inventory over `workers` with `proxy:` settings (listen on a free port)."""
    import yaml

    doc = {
        "cluster": "chaos",
        "workers": [{"name": w.name, "url": w.url, "model": MODEL,
                     "admin": {"token_env": "CHAOS_SIM_TOKEN"}} for w in workers],
        "proxy": {"listen": "127.0.0.1:0", "scrape_interval_s": 0.1, **proxy},
    }
    path = folder / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@contextlib.contextmanager
def serving(argv: list[str], env: dict[str, str], log: Path, pattern: str,
            deadline_s: float) -> Iterator[str]:
    """`ftctl ARGV`, its stderr in `log`; yields the URL `pattern` finds there once it serves."""
    with log.open("wb") as sink:
        proc = subprocess.Popen([PY, "-m", "dynamo_ftctl", *argv], stdout=subprocess.DEVNULL,
                                stderr=sink, env={**os.environ, **env})
    try:
        found: list[str] = []

        def up() -> bool:
            match = re.search(pattern, log.read_text(errors="replace"))
            if match:
                found.append(match.group(1))
            if proc.poll() is not None:
                msg = f"ftctl {argv[-1]} exited: {log.read_text(errors='replace')[-500:]}"
                raise RuntimeError(msg)
            return bool(found)

        wait_until(up, deadline_s, f"ftctl {' '.join(argv[2:])}")
        yield found[0]
    finally:
        stop(proc)


@contextlib.contextmanager
def proxy(inventory: Path, log: Path) -> Iterator[str]:
    """`ftctl proxy` over `inventory`; yields its URL once it serves."""
    with serving(["-i", str(inventory), "proxy"],
                 {"FTCTL_ADMIN_TOKEN": PROXY_TOKEN, "CHAOS_SIM_TOKEN": SIM_TOKEN}, log,
                 r"serving \d+ workers on (http://\S+)", 30) as url:
        yield url


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def completion(prompt: str = "hello", max_tokens: int = 4) -> dict[str, Any]:
    """A small completion request body."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}


# ------------------------------------------------------------------ the eight attacks


def attack_poison(tmp: Path) -> Row:
    """1. Poison requests (a lone surrogate) x3 over 2 workers, then normal traffic."""
    poison = b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 4}' % MODEL.encode()
    with sims(2) as workers, proxy(write_inventory(tmp, workers), tmp / "proxy.log") as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        bad = [client.post("/v1/completions", content=poison,
                           headers={"content-type": "application/json"}).status_code
               for _ in range(3)]
        good = [client.post("/v1/completions", json=completion()).status_code
                for _ in range(5)]
        health = client.get("/health").json()
    open_breakers = sum(1 for w in health.get("workers", {}).values()
                        if isinstance(w, dict) and w.get("breaker") not in (None, "closed"))
    ok = bad == [400] * 3 and good == [200] * 5 and open_breakers == 0
    return Row("poison request x3, 2 workers",
               "poison 400 x3; then 200 x5; 0 breakers open",
               f"poison {bad}; then {good}; {open_breakers} breakers open", ok)


@contextlib.contextmanager
def daemon(tmp: Path, workers: list[SimWorker]) -> Iterator[str]:
    """`ftctl canary --watch` over `workers` (token $FTCTL_DAEMON_TOKEN); yields its URL."""
    inventory = {
        "cluster": "chaos",
        "workers": [{"name": w.name, "url": w.url, "model": MODEL} for w in workers],
        "canary": {"interval_s": 1.0, "timeout_s": 2.0, "max_retries": 0,
                   "set": str(ROOT / "canaries" / f"{MODEL}.yaml"),
                   "state_file": str(tmp / "state.json")},
    }
    path = tmp / "daemon.json"
    path.write_text(json.dumps(inventory))
    with serving(["-i", str(path), "canary", "--watch", "--listen", "127.0.0.1:0"],
                 {"FTCTL_DAEMON_TOKEN": DAEMON_TOKEN}, tmp / "daemon.log",
                 r"(http://127\.0\.0\.1:\d+)", 60) as url:
        yield url


def daemon_view(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """The daemon's GET /workers, by worker name."""
    return {w["name"]: w for w in client.get("/workers").json()["workers"]}


def probes_of(client: httpx.Client, worker: str) -> float:
    """How many canary probes the daemon has made of `worker` (its duration histogram)."""
    name = re.escape(worker)
    pattern = re.compile(rf'^ftctl_canary_probe_duration_seconds_count\{{[^}}]*worker="{name}"'
                         r"[^}]*\} (\S+)$", re.MULTILINE)
    return sum(float(m.group(1)) for m in pattern.finditer(client.get("/metrics").text))


def attack_forged_reports(tmp: Path) -> Row:
    """2. Forged reports: drain a healthy worker; hold up a corrupting one with ok reports."""
    with sims(1) as good, sims(1, "--fault", "sdc") as bad:
        good[0].name, bad[0].name = "w1", "w2"
        with daemon(tmp, [good[0], bad[0]]) as url, \
                httpx.Client(base_url=url, timeout=10) as client:
            wait_until(lambda: all(w["last"] is not None for w in daemon_view(client).values()),
                       60, "the daemon's first round")
            forged = [client.post("/report", json={"worker": "w1", "ok": False,
                                                   "reason": "forged"}).status_code
                      for _ in range(5)]
            drained = daemon_view(client)["w1"]["state"]
            auth = {"Authorization": f"bearer {DAEMON_TOKEN}"}
            before = probes_of(client, "w2")
            start = time.monotonic()
            codes: dict[int, int] = {}
            for _ in range(200):  # a stream of ok reports for the corrupting worker, ~2 s
                code = client.post("/report", headers=auth,
                                   json={"worker": "w2", "ok": True}).status_code
                codes[code] = codes.get(code, 0) + 1
                time.sleep(0.01)
            seconds = time.monotonic() - start
            probes_per_s = (probes_of(client, "w2") - before) / seconds
            wait_until(lambda: daemon_view(client)["w2"]["state"] == "unhealthy", 30,
                       "the corrupting worker unhealthy")
            corrupt = daemon_view(client)["w2"]["state"]
    ok = (forged == [401] * 5 and drained == "healthy" and corrupt == "unhealthy"
          and codes.get(429, 0) > 0 and before >= 1 and probes_per_s <= 2)
    return Row("forged reports: 5 unauthenticated drains; 200 ok reports for an SDC worker",
               "401 x5, w1 healthy; 429 past the burst; SDC worker unhealthy; <= 2 probes/s",
               f"{forged}, w1 {drained}; answers {codes}; SDC worker {corrupt};"
               f" {probes_per_s:.1f} probes/s ({before:.0f} before)", ok)


def attack_admission(tmp: Path) -> Row:
    """5. Retained KV of gone clients over the busy threshold, then an idle engine; and the
    time from a worker's saturation to the proxy's first 503 under a 3x overload."""
    import admission  # benchmarks/admission.py: the saturation-to-shed measurement

    with sims(1, "--model-config", "ftctl-sim-tiny-small-cache") as workers, \
            proxy(write_inventory(tmp, workers), tmp / "proxy.log") as url:
        worker = workers[0]
        admin = {"Authorization": f"Bearer {SIM_TOKEN}"}
        httpx.post(f"{worker.url}/admin/fault", json={"kind": "slow", "delay_ms": 20},
                   headers=admin, timeout=5).raise_for_status()
        # Two clients leave after 135 tokens: ~2 x 11 of the pool's 24 blocks retained.
        cutters = [threading.Thread(target=cut_stream, args=(url, f"chaos-cut-{i}", 135))
                   for i in range(2)]
        for thread in cutters:
            thread.start()
        for thread in cutters:
            thread.join(60)
        wait_until(lambda: gauge(worker.url, "vllm:num_requests_running") == 0, 20,
                   "the worker to drop the cut streams")
        httpx.post(f"{worker.url}/admin/fault", json={"kind": "clear"}, headers=admin,
                   timeout=5).raise_for_status()
        time.sleep(0.5)  # let the proxy scrape the idle, retaining worker a few times
        statuses: list[int] = []
        start = time.monotonic()

        def admitted() -> bool:
            statuses.append(httpx.post(f"{url}/v1/completions", json=completion("hi", 1),
                                       timeout=30).status_code)
            return statuses[-1] == 200

        wait_until(admitted, 20, "a request admitted")
        admitted_s = time.monotonic() - start
    args = argparse.Namespace(capacity_s=3.0, scrape_interval_s=None, overload=3.0,
                              seconds=3.0, poll_ms=5.0)
    run = asyncio.run(admission.one_run(tmp, admission.WORKLOADS["kv"], args, None))
    delay = run.delay_ms
    ok = statuses[0] == 200 and delay is not None and delay <= 100
    shed = "never" if delay is None else f"{delay:.0f} ms"
    return Row("retained KV over the threshold, idle engine; 3x overload",
               "next request 200 at once; first 503 <= 100 ms after saturation",
               f"statuses {statuses[:5]} ({admitted_s:.2f} s); first 503 {shed} after"
               f" saturation ({run.shed} shed, {run.served} served)", ok)


def lock_holder(path: Path, marker: Path) -> subprocess.Popen[bytes]:
    """`ftctl lock acquire --path PATH -- CMD`, CMD noting a SIGTERM in `marker`."""
    script = f'trap "echo TERM >> {marker}; exit 143" TERM; while :; do sleep 0.02; done'
    return subprocess.Popen([PY, "-m", "dynamo_ftctl", "lock", "acquire", "--path", str(path),
                             "--", "sh", "-c", script], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def held_token(path: Path, pid: int) -> int:
    """The fencing token once the holder with `pid` owns the lock at `path`."""
    found: list[int] = []

    def owned() -> bool:
        code, out, _, _, _ = ftctl("lock", "owner", "--path", str(path), "--json")
        if code == 0:
            doc = json.loads(out)
            owner = doc.get("owner", doc)
            # Its own record: while a new file settles, the file's old data shows.
            if owner.get("alive", True) and owner.get("pid") == pid:
                found.append(int(owner["token"]))
        return bool(found)

    wait_until(owned, 30, f"pid {pid} holding {path}")
    return found[-1]


def told_within(holder: subprocess.Popen[bytes], marker: Path, start: float) -> float:
    """Seconds from `start` until the holder's CMD got SIGTERM (10 s at most)."""
    wait_until(lambda: marker.exists() and "TERM" in marker.read_text(), 10, "the SIGTERM")
    seen = time.monotonic() - start
    holder.wait(10)
    marker.unlink()
    return seen


def attack_lock_file(tmp: Path) -> Row:
    """6. The held lock file deleted, then replaced by a forged one claiming token 1001."""
    path, marker = tmp / "engine.lock", tmp / "term"
    first = lock_holder(path, marker)
    try:
        t1 = held_token(path, first.pid)
        start = time.monotonic()
        path.unlink()
        deleted_s = told_within(first, marker, start)
        second = lock_holder(path, marker)
        t2 = held_token(path, second.pid)
        forged = json.loads(path.read_text())
        forged["token"] = 1001
        fake = tmp / "forged.lock"
        fake.write_text(json.dumps(forged))
        start = time.monotonic()
        fake.replace(path)
        replaced_s = told_within(second, marker, start)
        third = lock_holder(path, marker)
        t3 = held_token(path, third.pid)
        stop(third)
    finally:
        for proc in (first, locals().get("second"), locals().get("third")):
            if isinstance(proc, subprocess.Popen):
                stop(proc)
                if proc.stderr is not None:
                    proc.stderr.close()
    ok = deleted_s < 2 and replaced_s < 2 and t1 < t2 < t3 < t2 + 2**40
    return Row("lock file deleted, then replaced by a forged token 1001",
               "holder's CMD SIGTERMed < 2 s each time; tokens t1 < t2 < t3, the forged "
               "claim ignored",
               f"SIGTERM after {deleted_s:.2f} s / {replaced_s:.2f} s; tokens {t1}, {t2}, {t3}",
               ok)


def attack_sleep(tmp: Path) -> Row:  # noqa: ARG001 (every attack takes its temp folder)
    """7. `/sleep` on a sim without a token while a stream is in flight."""
    with sims(1) as workers, httpx.Client(base_url=workers[0].url, timeout=30) as client:
        tokens: list[str] = []
        done = threading.Event()

        def read() -> None:
            body = {**completion("a long answer", 200), "stream": True, "ignore_eos": True}
            with client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        tokens.append(line)
            done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_until(lambda: len(tokens) >= 3, 30, "the stream's first tokens")
        asked = [client.post("/sleep", params={"level": 1}, headers=h).status_code
                 for h in ({}, {"Authorization": "Bearer wrong"},
                           {"X-Api-Key": SIM_TOKEN})]
        asked.append(client.post("/sleep", params={"level": 1, "token": SIM_TOKEN}).status_code)
        wait_until(done.is_set, 60, "the stream's end")
        asleep = client.get("/is_sleeping").json()
    ok = asked == [401] * 4 and len(tokens) == 200 and asleep.get("is_sleeping") is False
    return Row("/sleep without a token (none, wrong, other header, query) mid-stream",
               "401 x4; the stream ends whole (200 tokens); engine awake",
               f"{asked}; stream {len(tokens)} tokens; asleep: {asleep.get('is_sleeping')}", ok)


YAML_BOMB_COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "inventory check": lambda p, _tmp: ["-i", str(p), "inventory", "check"],
    "canary --set": lambda p, _tmp: ["canary", "--url", "http://127.0.0.1:9", "--set", str(p),
                                     "--no-state"],
    "drill": lambda p, tmp: ["drill", str(p), "--out", str(tmp / "report"), "--no-plot"],
}


def yaml_bomb_rows(tmp: Path) -> list[Row]:
    """One row per alias bomb of `tests/unit/foundation/bombs.py` (issue 22's billion laughs,
    issue 30's large scalars repeated flat and through nested lists): each command that
    reads user YAML, with the parse cache on (twice: the second would hit what the first
    stored) and off; every run must exit 2 with one line, fast and small, caching nothing."""
    from tests.unit.foundation.bombs import ALIAS_BOMBS

    rows = []
    for name, (text, words) in ALIAS_BOMBS.items():
        bomb = tmp / f"{name}.yaml"
        bomb.write_text(text())
        cache = tmp / f"cache-{name}"
        runs = []
        for command, argv in YAML_BOMB_COMMANDS.items():
            for env in ({"XDG_CACHE_HOME": str(cache)}, {"XDG_CACHE_HOME": str(cache)},
                        {"FTCTL_NO_CACHE": "1"}):
                code, _, err, wall, rss = ftctl(*argv(bomb, tmp), env={**env,
                                                "FTCTL_INVENTORY": ""}, timeout_s=20)
                runs.append((command, code, err.strip().splitlines(), wall, rss))
        cached = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) \
            if cache.exists() else 0
        codes = sorted({r[1] for r in runs})
        lines = sorted({len(r[2]) for r in runs})
        worded = all(len(r[2]) == 1 and words in r[2][0] for r in runs)
        wall = max(r[3] for r in runs)
        rss = max(r[4] for r in runs)
        ok = codes == [2] and lines == [1] and worded and wall < 5 and rss < 400 and not cached
        size = bomb.stat().st_size
        rows.append(Row(
            f"YAML {name} ({size / 1000:,.0f} KB): {len(runs)} runs",
            "exit 2, one line naming the bound, < 5 s, < 400 MiB, nothing cached",
            f"exit {codes}, {lines} lines, bound named: {worded}, max {wall:.2f} s,"
            f" {rss:.0f} MiB, cache {cached} B", ok))
    return rows


def attack_yaml_bomb(tmp: Path) -> Row:
    """3. YAML alias bombs at inventories, canary sets and drills (see `yaml_bomb_rows`)."""
    rows = yaml_bomb_rows(tmp)
    return Row(f"YAML alias bombs ({len(rows)} kinds x inventory/canary/drill, cache on/off)",
               rows[0].expected,
               "; ".join(f"{r.attack.split(' (')[0].removeprefix('YAML ')}:"
                         f" {'ok' if r.ok else r.observed}" for r in rows),
               all(r.ok for r in rows))


def attack_out_targets(tmp: Path) -> Row:
    """4. `--out` naming a FIFO, a device node and an unwritable path."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    device = tmp / "null-device"
    targets = [fifo]
    if os.geteuid() == 0:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
        targets.append(device)
    blocker = tmp / "a-file"
    blocker.write_text("not a directory\n")
    unwritable = blocker / "out"
    with sims(1) as workers:
        url = workers[0].url
        outcomes = []
        for target in [*targets, unwritable]:
            code, _, err, _, _ = ftctl("canary", "record", "--url", url, "--model", MODEL,
                                       "--out", str(target), timeout_s=120)
            outcomes.append((code, len(err.strip().splitlines())))
    kinds_kept = stat.S_ISFIFO(fifo.lstat().st_mode) and (
        not device.exists() or stat.S_ISCHR(device.lstat().st_mode))
    ok = all(code in (1, 2) and lines == 1 for code, lines in outcomes) and kinds_kept
    return Row("--out FIFO / device node / file as a folder",
               "exit 1 or 2, one line each; nodes untouched",
               f"(exit, lines) {outcomes}; nodes untouched: {kinds_kept}", ok)


def attack_caps(tmp: Path) -> Row:
    """8. Proxy caps: deep JSON, NaN, h2c upgrade, connection flood, partial-body memory."""
    with sims(1) as workers, proxy(write_inventory(tmp, workers, max_connections=64,
                                                   max_buffered_mib=32),
                                   tmp / "proxy.log") as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        deep = client.post("/v1/completions", content=b"[" * 100_000,
                           headers={"content-type": "application/json"}).status_code
        nan = client.post("/v1/completions",
                          content=b'{"model": "%s", "prompt": "x", "max_tokens": NaN}'
                          % MODEL.encode(),
                          headers={"content-type": "application/json"}).status_code
        h2c = h2c_status(url)
        flood = connection_flood(url, 200)
        held_mib = partial_bodies(url, 30, 14)
        after = client.post("/v1/completions", json=completion()).status_code
    ok = (deep == 400 and nan == 400 and h2c.startswith("HTTP/1.1 200")
          and flood["200"] + flood["503"] + flood["closed"] + flood["reset"] == 200
          and 60 <= flood["200"] < 64 and flood["503"] > 0 and after == 200 and held_mib < 200)
    return Row("deep JSON / NaN / h2c / 200 conns / 30x14 MiB bodies",
               "400 / 400 / HTTP/1.1 200 / 200 up to the cap of 64, then 503 (16 refusals"
               " at a time), past that closed or reset, none hang / RSS bounded by the"
               " 32 MiB cap / still serves",
               f"{deep} / {nan} / {h2c} / {flood} / +{held_mib:.0f} MiB; after: {after}", ok)


def h2c_status(url: str) -> str:
    """The status line `curl --http2` (an h2c upgrade) gets, or a raw-socket stand-in."""
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-s", "-i", "--http2", "--max-time", "20",
                              f"{url}/v1/models"], capture_output=True, check=False, timeout=30)
        return out.stdout.split(b"\r\n", 1)[0].decode(errors="replace") or "empty reply"
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings"
                     b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n")
        return sock.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace") or "empty reply"


def connection_flood(url: str, count: int) -> dict[str, int]:
    """`count` clients that each ask once and keep their connection open: answers by kind."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    tally = {"200": 0, "503": 0, "closed": 0, "reset": 0, "other": 0}
    try:
        for _ in range(count):
            try:
                sock = socket.create_connection((host, int(port)), timeout=10)
                socks.append(sock)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                head = sock.recv(4096).split(b"\r\n", 1)[0]
            except OSError:
                tally["reset"] += 1
                continue
            parts = head.split(b" ")
            key = parts[1].decode(errors="replace") if len(parts) > 1 else "closed"
            tally[key if key in tally else "other"] += 1
    finally:
        for sock in socks:
            sock.close()
    return tally


def partial_bodies(url: str, count: int, mib: int) -> float:
    """RSS growth (MiB) of the process listening at `url` while `count` clients each
    hold `mib` MiB of a body they never finish."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    pid = listener_pid(int(port))
    before = rss_mib(pid)
    chunk = b"x" * (1 << 20)
    socks = []
    peak = before
    try:
        for _ in range(count):
            sock = socket.create_connection((host, int(port)), timeout=10)
            socks.append(sock)
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    f"\r\nContent-Length: {(mib + 1) << 20}\r\n\r\n").encode()
            with contextlib.suppress(OSError):
                sock.sendall(head)
                for _ in range(mib):
                    sock.sendall(chunk)
            peak = max(peak, rss_mib(pid))
    finally:
        for sock in socks:
            sock.close()
    return peak - before


def listener_pid(port: int) -> int:
    """The pid of the process listening on loopback `port` (from /proc/net/tcp and fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), Path(table).open() as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(fields[9])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                target = str(fd.readlink())
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(entry.name)
    msg = f"no process listens on port {port}"
    raise RuntimeError(msg)


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------ issue 29: the judgment

POISON_SEED = 666  # the sims' poison fault: a request with this seed ends its whole batch


def breakers_open(client: httpx.Client) -> list[str]:
    """The workers whose breaker the proxy has open (its /health)."""
    workers = client.get("/health").json().get("workers", {})
    return [n for n, w in workers.items() if isinstance(w, dict) and w.get("breaker") == "open"]


def poison_body(max_tokens: int = 8) -> dict[str, Any]:
    return {**completion("poison", max_tokens), "seed": POISON_SEED, "temperature": 1}


def healthy_statuses(client: httpx.Client, count: int = 5) -> list[int]:
    return [client.post("/v1/completions", json=completion()).status_code
            for _ in range(count)]


def attack_poison_burst(tmp: Path) -> Row:
    """9. 30 batch-killing requests at once over 2 sims, then normal traffic."""
    from concurrent.futures import ThreadPoolExecutor

    with sims(2, "--fault", f"poison:seed={POISON_SEED}") as workers, \
            proxy(write_inventory(tmp, workers), tmp / "proxy.log") as url, \
            httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(30) as pool:
        bad = sorted(set(pool.map(lambda _: client.post("/v1/completions",
                                                        json=poison_body()).status_code,
                                  range(30))))
        good = healthy_statuses(client)
        opened = breakers_open(client)
    ok = set(bad) <= {422, 502, 503} and good == [200] * 5 and not opened
    return Row("poison burst: 30 batch-killers at once, 2 sims",
               "each 422/502/503; then 200 x5; no breaker open",
               f"{bad}; then {good}; open: {opened or 'none'}", ok)


def attack_one_worker(tmp: Path) -> Row:
    """10. Poison on a one-worker fleet: no second opinion."""
    with sims(1, "--fault", f"poison:seed={POISON_SEED}") as workers, \
            proxy(write_inventory(tmp, workers), tmp / "proxy.log") as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        bad = [client.post("/v1/completions", json=poison_body()).status_code
               for _ in range(5)]
        good = healthy_statuses(client)
        opened = breakers_open(client)
    ok = all(s in (422, 502) for s in bad) and good == [200] * 5 and not opened
    return Row("poison x5 on a one-worker fleet", "422/502 each; then 200 x5; breaker closed",
               f"{bad}; then {good}; open: {opened or 'none'}", ok)


def attack_batch_kill(tmp: Path) -> Row:
    """11. A request that ends every stream batched with it, while 6 greedy streams run."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "prompt": "Tokens must not be lost", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with sims(2, "--fault", f"poison:seed={POISON_SEED}") as workers, \
            proxy(write_inventory(tmp, workers), tmp / "proxy.log") as url, \
            httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        reference = httpx.post(f"{workers[0].url}/v1/completions",
                               json={**body, "stream": False}, timeout=60).json()
        expected = reference["choices"][0]["text"]
        for worker in workers:
            httpx.post(f"{worker.url}/admin/fault", json={"kind": "slow", "delay_ms": 30},
                       headers={"Authorization": f"Bearer {SIM_TOKEN}"}, timeout=5)
        rounds = []
        for _ in range(3):
            victims = [pool.submit(stream_text_of, url, body) for _ in range(6)]
            wait_until(lambda: sum(gauge(w.url, "vllm:num_requests_running")
                                   for w in workers) >= 6, 20, "6 streams under way")
            rounds.append(client.post("/v1/completions", json=poison_body()).status_code)
            texts = [v.result(timeout=90) for v in victims]
            rounds.append(sum(t == expected for t in texts))
        opened = breakers_open(client)
    statuses, intact = rounds[0::2], rounds[1::2]
    ok = all(s == 422 for s in statuses) and intact == [6, 6, 6] and not opened
    return Row("batch-killing request x3 amid 6 greedy streams, 2 sims",
               "422 each; 6 of 6 streams identical each time; no breaker open",
               f"{statuses}; identical {intact}; open: {opened or 'none'}", ok)


def stream_text_of(url: str, body: dict[str, Any]) -> str:
    """The text of a streamed completion through `url`."""
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=90) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                doc = json.loads(line[6:])
                for choice in doc.get("choices") or ():
                    text += choice.get("text") or ""
    return text


def upstream(url: str) -> Any:
    """A stand-in upstream as `write_inventory` takes a worker (a name and a URL)."""
    from types import SimpleNamespace

    return SimpleNamespace(name="stand-in", url=url)


def attack_backpressure(tmp: Path) -> Row:
    """12. An upstream that answers 429 with Retry-After: 30 (a loopback stand-in)."""
    with stand_in(429, "30") as (full, url), sims(1) as workers:
        with proxy(write_inventory(tmp, [upstream(url), *workers]), tmp / "proxy.log") as at, \
                httpx.Client(base_url=at, timeout=60) as client:
            two = healthy_statuses(client, 4)
            opened = breakers_open(client)
        (tmp / "one").mkdir()
        with proxy(write_inventory(tmp / "one", [upstream(url)]), tmp / "proxy1.log") as at, \
                httpx.Client(base_url=at, timeout=60) as client:
            one = client.post("/v1/completions", json=completion())
            opened += breakers_open(client)
    retry = one.headers.get("retry-after")
    ok = two == [200] * 4 and one.status_code == 429 and retry is not None \
        and 25 <= int(retry) <= 30 and full.requests <= 2 and not opened
    return Row("upstream 429 + Retry-After: 30", "2 workers: 200 x4, the full one asked once "
               "(then spared); 1 worker: 429 with Retry-After ~30; no breaker open",
               f"{two}, asked {full.requests}x in all; {one.status_code} Retry-After {retry}; "
               f"open: {opened or 'none'}", ok)


def attack_expired_frontend(tmp: Path) -> Row:
    """13. A frontend that lost its workers: empty 404 to every generation (Dynamo 1.6)."""
    with stand_in(404) as (empty, url), sims(1) as workers, \
            proxy(write_inventory(tmp, [upstream(url), *workers]), tmp / "proxy.log") as at, \
            httpx.Client(base_url=at, timeout=60) as client:
        served = healthy_statuses(client, 6)
        view = client.get("/health").json()["workers"]["stand-in"]
        asked = empty.requests
        empty.status = 200  # its workers are back: the known-good probe passes
        wait_until(lambda: client.get("/health").json()["workers"]["stand-in"]["weight"]
                   > 0, 10, "the frontend back in routing")
    ok = served == [200] * 6 and view["weight"] == 0 and view["breaker"] == "closed"
    return Row("frontend without workers (empty 404; a stand-in, Dynamo not in the suite yet)",
               "200 x6 from the other; it is out (weight 0, breaker closed), back when it serves",
               f"{served}; weight {view['weight']}, breaker {view['breaker']}, asked {asked}x; "
               "back: yes", ok)


def attack_request_ids(tmp: Path) -> Row:
    """14. A client holding a stream under another's X-Request-Id (the sim refuses a running
    id with 409, as a strict engine does)."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    with sims(1, "--fault", "slow:delay_ms=30") as workers, \
            proxy(write_inventory(tmp, workers), tmp / "proxy.log") as url, \
            ThreadPoolExecutor(2) as pool:
        def one() -> int:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                              headers={"X-Request-Id": "taken"}) as resp:
                resp.read()
                return resp.status_code
        first = pool.submit(one)
        wait_until(lambda: gauge(workers[0].url, "vllm:num_requests_running") >= 1, 20,
                   "the first stream")
        second = one()
        statuses = [first.result(timeout=60), second]
    ok = statuses == [200, 200]
    return Row("two clients, one X-Request-Id, a worker that refuses a running id",
               "200 both", f"{statuses}", ok)


def attack_vllm(tmp: Path) -> Row:
    """16. On real vLLM (the suite's tiny Llama, CPU): 30 requests vLLM refuses (400) at once
    over two servers, then one server SIGKILLed: the refusals reach the clients and move no
    breaker; the dead server, which fails the known-good probe, is taken out and the live
    one serves. Skipped (ok) without the vLLM venv (`make vllm`)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.vllm.server import (
        spawn_vllm,
        tiny_llama_dir,
        vllm_python,
        wait_healthy,
    )

    python = vllm_python()
    if not python.exists():
        return Row("vLLM: refusals, then a killed server", "skipped without `make vllm`",
                   f"no vLLM venv at {python}", True)
    model = tiny_llama_dir(python)
    cpus = sorted(os.sched_getaffinity(0))
    servers = [spawn_vllm(python, model, tmp / f"vllm{i}.log", name=f"vllm{i}",
                          cpu=cpus[i % len(cpus)]) for i in range(2)]
    try:
        began = time.monotonic()
        for server in servers:
            wait_healthy(server, began)
        import yaml

        doc = {"cluster": "chaos-vllm",
               "workers": [{"name": s.name, "url": s.url, "model": s.model}
                           for s in servers],
               "proxy": {"listen": "127.0.0.1:0", "scrape_interval_s": 0.1,
                         "breaker_threshold": 1, "stall_timeout_s": 10}}
        inventory = tmp / "inventory.yaml"
        inventory.write_text(yaml.safe_dump(doc))
        served = servers[0].model
        refused = {"model": served, "prompt": "hello", "max_tokens": 4, "stop_token_ids": ["x"]}
        ok_body = {"model": served, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        with proxy(inventory, tmp / "proxy.log") as url, \
                httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(30) as pool:
            bad = sorted(set(pool.map(lambda _: client.post("/v1/completions",
                                                            json=refused).status_code,
                                      range(30))))
            open_after_refusals = breakers_open(client)
            os.killpg(servers[0].proc.pid, signal.SIGKILL)  # the server and its engine core
            after = [client.post("/v1/completions", json=ok_body).status_code
                     for _ in range(4)]
            wait_until(lambda: breakers_open(client) == [servers[0].name], 20,
                       "the dead server's breaker")
            opened = breakers_open(client)
    finally:
        for server in servers:
            server.stop()
    ok = bad == [400] and not open_after_refusals and after == [200] * 4 \
        and opened == [servers[0].name]
    return Row("vLLM: 30 refused requests at once, then one server SIGKILLed",
               "400 x30, no breaker; then 200 x4, only the dead server's breaker open",
               f"{bad}, open: {open_after_refusals or 'none'}; then {after}, open: {opened}",
               ok)


# ------------------------------------------------------------------ issue 30: files

TABLES: list[str] = []  # tables an attack prints after the rows (the hostile-file matrix)


def attack_hostile_files(tmp: Path) -> Row:  # noqa: ARG001 (every attack takes its folder)
    """15. Every output and log option against symlinks, FIFOs, devices, sockets, hard links
    and names that climb out (tests/hostilefiles.py; its table is printed after the rows)."""
    from tests.hostilefiles import render, run_matrix

    rows = run_matrix()
    TABLES.append(render(rows))
    bad = [f"{r.option} {r.kind}: {r.observed}" for r in rows if not r.ok]
    return Row(f"hostile files: {len(rows)} option x kind cases", "each refused or safe, "
               "victim unchanged, nothing half-written, no hang",
               f"{len(rows) - len(bad)} of {len(rows)} as expected" + (f"; {bad}" if bad else ""),
               not bad)


def attack_lock_takeover(tmp: Path) -> Row:  # noqa: ARG001 (every attack takes its folder)
    """17. The lock's files under attack with the default settings (0.5 s watch, 5 s
    grace): a symbolic link at P and at P.floor; `rm P` and `rm P P.floor` while a holder
    that ignores SIGTERM runs (tests/integration/lock/hostile_files.py)."""
    from tests.integration.lock.hostile_files import chaos_rows

    rows = chaos_rows()
    width = max(len(attack) for attack, _, _, _ in rows)
    TABLES.append("\n".join(
        [f"{'lock attack':<{width}}  ok  observed"]
        + [f"{attack:<{width}}  {'yes' if ok else 'NO '} {observed}"
           for attack, _, observed, ok in rows]))
    bad = [attack for attack, _, _, ok in rows if not ok]
    return Row(f"lock files: {len(rows)} attacks (links, rm while held)",
               "links refused (exit 2, victim unchanged); one holder at a time, tokens rise",
               f"{len(rows) - len(bad)} of {len(rows)} as expected (table below)"
               + (f"; failed: {bad}" if bad else ""), not bad)


ATTACKS: dict[int, Callable[[Path], Row]] = {
    1: attack_poison,
    2: attack_forged_reports,
    3: attack_yaml_bomb,
    4: attack_out_targets,
    5: attack_admission,
    6: attack_lock_file,
    7: attack_sleep,
    8: attack_caps,
    9: attack_poison_burst,
    10: attack_one_worker,
    11: attack_batch_kill,
    12: attack_backpressure,
    13: attack_expired_frontend,
    14: attack_request_ids,
    15: attack_hostile_files,
    16: attack_vllm,
    17: attack_lock_takeover,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="attack numbers, comma-separated")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    opts = parser.parse_args()
    chosen = [int(n) for n in opts.only.split(",") if n] or sorted(ATTACKS)
    rows: list[Row] = []
    for number in chosen:
        with tempfile.TemporaryDirectory(prefix=f"ftctl-chaos-{number}-") as folder:
            try:
                rows.append(ATTACKS[number](Path(folder)))
            except Exception as exc:
                rows.append(Row(f"attack {number}", "a row", f"crashed: {exc}", False))
    if opts.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        width = max(len(r.attack) for r in rows)
        for i, r in zip(chosen, rows, strict=True):
            mark = "ok  " if r.ok else "FAIL"
            print(f"{mark} {i}. {r.attack:<{width}}  expected: {r.expected}\n"
                  f"     {'':<{width + 3}}  observed: {r.observed}")
        for table in TABLES:
            print(f"\n{table}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
