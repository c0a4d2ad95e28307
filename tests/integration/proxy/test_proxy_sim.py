"""The migrating proxy as a real process in front of real `ftctl sim` workers."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from dynamo_ftctl.http1 import HttpError, Reply
from dynamo_ftctl.openai import iter_sse_events
from tests import fetch
from tests.simfaults import hung
from tests.waiting import wait_until

if TYPE_CHECKING:
    from dynamo_ftctl.engine.launcher import SimWorker

pytestmark = pytest.mark.integration

PROXY_ADMIN_TOKEN = "proxy-test-token"
MODEL = "ftctl-sim-tiny"


@dataclass
class ProxyProcess:
    """A running proxy: its URL, process and log file (and its inventory's, where known)."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    inventory: Path | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _wait_for_url(proxy_log: Path, proc: subprocess.Popen[bytes], deadline_s: float) -> str:
    """The URL the proxy prints once it serves (a condition with a deadline)."""
    pattern = re.compile(r"serving \d+ workers on (http://\S+)")

    def log() -> str:
        text = proxy_log.read_text(errors="replace")
        assert pattern.search(text) or proc.poll() is None, f"proxy did not start: {text[-2000:]}"
        return text

    found = pattern.search(wait_until(log, deadline_s, "the proxy's 'serving' line",
                                      accept=pattern.search))
    assert found is not None
    return found.group(1)


def spawn_proxy(inventory: dict[str, Any], tmp_path: Path, name: str = "proxy",
                env: dict[str, str] | None = None) -> ProxyProcess:
    """`ftctl proxy` over `inventory` (written to tmp_path/<name>.yaml, its stderr to
    <name>.log), once it serves; stopped again when it does not come up."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(inventory))
    log = tmp_path / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "dynamo_ftctl", "-i", str(path), "proxy"],
                                stdout=subprocess.DEVNULL, stderr=sink,
                                env=dict(os.environ) if env is None else env)
    proxy = ProxyProcess(url="", proc=proc, log=log, inventory=path)
    try:
        proxy.url = _wait_for_url(log, proc, 30.0)
    except BaseException:
        proxy.stop()
        raise
    return proxy


ProxyFactory = Callable[..., ProxyProcess]


@pytest.fixture
def proxy_factory(tmp_path: Path) -> Iterator[ProxyFactory]:
    """Start `ftctl proxy` over [(name, url), ...] with `proxy:` settings; stopped at teardown."""
    started: list[ProxyProcess] = []

    def factory(workers: list[tuple[str, str]], *, worker_admin_token: str | None = None,
                model: str = MODEL, worker_fields: dict[str, Any] | None = None,
                **settings: Any) -> ProxyProcess:
        index = len(started)
        admin = {"admin": {"token_env": "SIM_ADMIN_TOKEN"}} if worker_admin_token else {}
        extra = {**admin, **(worker_fields or {})}
        inventory = {
            "cluster": "proxy-test",
            "workers": [{"name": n, "url": u, "model": model, **extra} for n, u in workers],
            "proxy": {"listen": "127.0.0.1:0", "scrape_interval_s": 0.1,
                      "stall_timeout_s": 5.0, **settings},
        }
        env = {**os.environ, "FTCTL_ADMIN_TOKEN": PROXY_ADMIN_TOKEN,
               "SIM_ADMIN_TOKEN": worker_admin_token or ""}
        proxy = spawn_proxy(inventory, tmp_path, f"proxy-{index}", env)
        started.append(proxy)
        return proxy

    try:
        yield factory
    finally:
        for proxy in started:
            proxy.stop()


def gauge(url: str, name: str) -> float:
    """One gauge (its first series) from the /metrics of `url` (a proxy or a worker)."""
    text = fetch.get(f"{url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith((f"{name} ", f"{name}{{")))
    return float(line.rsplit(" ", 1)[1])


def proxy_knows_max_len(proxy: ProxyProcess) -> bool:
    """True once the proxy learnt every worker's max_model_len (first scrape done)."""
    try:
        doc = fetch.get(f"{proxy.url}/v1/models", timeout=2).json()
    except (HttpError, TimeoutError):
        return False
    return all("max_model_len" in entry for entry in doc["data"])


MAX_TOKENS = 24


def set_fault(worker: SimWorker, fault: dict[str, Any]) -> None:
    resp = fetch.post(f"{worker.url}/admin/fault", json=fault, timeout=5,
                      headers={"Authorization": f"Bearer {worker.admin_token}"})
    assert resp.status == 200, resp.text


def request_body(i: int) -> tuple[str, dict[str, Any]]:
    """Request i: completions or chat, greedy or seeded sampling, with token ids."""
    endpoint = "/v1/chat/completions" if i % 2 else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    if (i // 2) % 2:
        body |= {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
    else:
        body |= {"temperature": 0.0}
    prompt = f"Request {i}: why do streams need to survive worker failures?"
    if endpoint == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return endpoint, body


def reference(worker: SimWorker, endpoint: str, body: dict[str, Any]) -> tuple[list[int], str]:
    """Token ids and text of the fault-free run, straight from a worker."""
    doc = fetch.post(f"{worker.url}{endpoint}", json={**body, "stream": False}, timeout=60).json()
    choice = doc["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return choice["token_ids"], text


@dataclass
class Streamed:
    """What a client saw of one streamed answer."""

    status: int
    headers: dict[str, str]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    error: str | None = None
    migrated: int = 0
    done: bool = False
    usage: dict[str, int] | None = None
    request_ids: set[str] = field(default_factory=set)


def stream(proxy: ProxyProcess, endpoint: str, body: dict[str, Any],
           on_chunk: Any = None, headers: dict[str, str] | None = None) -> Streamed:
    """Stream a request through the proxy and collect everything the client sees."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with fetch.stream("POST", f"{proxy.url}{endpoint}", json=payload, timeout=60,
                      headers=headers) as resp:
        out = Streamed(status=resp.status, headers=dict(resp.headers))
        raw = b""
        for piece in resp.iter_bytes():
            raw += piece
            if on_chunk is not None:
                on_chunk(out, raw)
    for line in raw.split(b"\n"):
        if line.startswith(b": x-ftctl-migrated:"):
            out.migrated = int(line.rsplit(b":", 1)[1])
    for event in iter_sse_events([raw]):
        if event.is_done:
            out.done = True
            continue
        doc = json.loads(event.data)
        if "error" in doc:
            out.error = doc["error"]["message"]
            continue
        out.request_ids.add(doc["id"])
        if doc.get("usage"):
            out.usage = doc["usage"]
        for choice in doc["choices"]:
            out.ids.extend(choice.get("token_ids") or [])
            delta = choice.get("delta")
            out.text += (delta.get("content") or "") if delta is not None else choice["text"]
            out.finish = choice.get("finish_reason") or out.finish
    return out


OnChunk = Callable[[Streamed, bytes], None]


def after_tokens(count: int, act: Callable[[str], None]) -> tuple[OnChunk, list[str]]:
    """A `stream` callback calling `act(serving worker)` once the client saw `count` tokens."""
    hit: list[str] = []

    def callback(out: Streamed, raw: bytes) -> None:
        if not hit and raw.count(b'"token_ids"') >= count:
            name = out.headers["x-ftctl-worker"].split(",")[-1]
            act(name)
            hit.append(name)

    return callback, hit


def test_hundred_streams_with_a_worker_failing_at_a_random_token_are_identical(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """100 streams, each with workers dropping it at a random token: outputs equal fault-free."""
    workers = [sim_worker_factory(name=f"w{i}") for i in range(3)]
    proxy = proxy_factory([(w.name, w.url) for w in workers], breaker_threshold=100000,
                          migration_limit=3)
    wait_until(lambda: proxy_knows_max_len(proxy), 20, "the proxy's first scrape")
    specs = [request_body(i) for i in range(100)]
    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda spec: reference(workers[0], *spec), specs))
    rng = random.Random(9)
    cuts = [rng.randint(1, MAX_TOKENS - 1) for _ in specs]
    migrated = 0
    # Requests that share a cut point run together (8 at a time) under one fault setting:
    # every worker drops its streams after `cut` tokens of their own when three hops cover
    # the output; else two of them do and the third is clean (exclusion finds it).
    for cut in sorted(set(cuts)):
        faulty = set(range(3)) if 3 * cut >= MAX_TOKENS else set(rng.sample(range(3), 2))
        for index, worker in enumerate(workers):
            set_fault(worker, {"kind": "disconnect", "after_tokens": cut} if index in faulty
                      else {"kind": "clear"})
        batch = [i for i, c in enumerate(cuts) if c == cut]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: stream(proxy, *specs[i]), batch))
        for i, got in zip(batch, results, strict=True):
            assert got.error is None, (i, cut, got.error)
            assert (got.ids, got.text) == expected[i], f"request {i} (cut at {cut}) differs"
            assert got.finish == "length"
            assert got.done
            assert len(got.request_ids) == 1
            assert got.usage is not None
            assert got.usage["completion_tokens"] == MAX_TOKENS
            migrated += got.migrated > 0
    # About 90% start on a worker that breaks; all of those must have been migrated.
    assert migrated >= 70, migrated
    metrics = fetch.get(f"{proxy.url}/metrics", timeout=5).text
    assert 'ftctl_migrations_total{method="reprefill"' in metrics


def test_lone_surrogate_prompts_are_400s_and_leave_every_breaker_closed(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """Issue 22 finding 1 end to end: prompts the byte tokenizer cannot encode, sent through
    the proxy to two sims, each get a 400 naming the prompt; no worker is charged (every
    breaker closed, no failure logged), and a normal request is served."""
    workers = [sim_worker_factory(name=f"p{i}", args=["--tokenizer", "byte"]) for i in range(2)]
    proxy = proxy_factory([(w.name, w.url) for w in workers])
    poison = json.dumps({"model": MODEL, "prompt": "\ud800", "max_tokens": 2}).encode()
    for _ in range(4):  # more than breaker_threshold (3)
        resp = fetch.post(f"{proxy.url}/v1/completions", content=poison, timeout=30,
                          headers={"Content-Type": "application/json"})
        assert resp.status == 400, resp.text
        assert resp.json()["error"]["param"] == "prompt"
    health = fetch.get(f"{proxy.url}/health", timeout=5).json()
    assert {w["breaker"] for w in health["workers"].values()} == {"closed"}
    assert "worker failed" not in proxy.log_text()
    got = stream(proxy, *request_body(0))
    assert (got.status, got.error, got.done) == (200, None, True)


def test_sigkilled_worker_mid_stream_is_continued_identically(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """SIGKILL of the serving worker mid-stream: the client's stream goes on unchanged."""
    workers = [sim_worker_factory(name=f"k{i}") for i in range(3)]
    proxy = proxy_factory([(w.name, w.url) for w in workers])
    by_name = {w.name: w for w in workers}
    for endpoint, body in (request_body(0), request_body(3)):
        live = [w for w in workers if w.alive]
        ids, text = reference(live[0], endpoint, {**body, "max_tokens": 40})
        for worker in live:
            set_fault(worker, {"kind": "slow", "delay_ms": 15})
        kill_after_five, killed = after_tokens(5, lambda name: by_name[name].kill())
        got = stream(proxy, endpoint, {**body, "max_tokens": 40}, on_chunk=kill_after_five)
        assert killed, "the stream ended before the kill"
        assert got.error is None
        assert (got.ids, got.text) == (ids, text)
        assert got.migrated >= 1  # plus a plain retry when the dead worker was tried first


def test_migration_limit_reached_ends_with_a_clean_error(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """Every worker breaking and migration_limit 1: an error event and [DONE], never a hang."""
    workers = [sim_worker_factory(name=f"l{i}") for i in range(2)]
    for worker in workers:
        set_fault(worker, {"kind": "disconnect", "after_tokens": 3})
    proxy = proxy_factory([(w.name, w.url) for w in workers], migration_limit=1)
    got = stream(proxy, *request_body(0))
    assert got.status == 200
    assert got.done
    assert got.error is not None
    assert "migration limit reached (1)" in got.error
    assert len(got.ids) == 6


def test_client_disconnect_cancels_the_upstream_request(
    sim_worker: SimWorker, proxy_factory: ProxyFactory,
) -> None:
    """A client leaving mid-stream makes the worker's running request go away."""
    set_fault(sim_worker, {"kind": "slow", "delay_ms": 50})
    proxy = proxy_factory([("w", sim_worker.url)])
    endpoint, body = request_body(0)
    with fetch.stream("POST", f"{proxy.url}{endpoint}", timeout=30,
                      json={**body, "stream": True, "max_tokens": 400}) as resp:
        for _ in resp.iter_bytes():
            break

    wait_until(lambda: gauge(sim_worker.url, "vllm:num_requests_running") == 0, 10,
               "the worker to drop the abandoned request")


def upstream_ms(headers: dict[str, str]) -> float:
    """The worker's time to first token that the proxy reports in Server-Timing."""
    match = re.fullmatch(r'upstream;desc="first token";dur=(\d+\.\d{3})',
                         headers["server-timing"])
    assert match is not None, headers["server-timing"]
    return float(match.group(1))


def through_a_stall(proxy: ProxyProcess, worker: SimWorker, send: Callable[[], Any],
                    stall_s: float) -> Any:
    """`send()`'s result while `worker` holds every request for `stall_s` once the proxy
    has taken it (a hung worker answers nothing, its /metrics included)."""
    set_fault(worker, {"kind": "hang"})
    wait_until(lambda: hung(worker), 10, "the worker to hang")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(send)
        wait_until(lambda: gauge(proxy.url, "ftctl_proxy_queued_requests") >= 1, 10,
                   "the proxy to take the request")
        time.sleep(stall_s)  # the worker's stall: what the proxy must report
        set_fault(worker, {"kind": "clear"})
        return future.result(timeout=30)


def test_server_timing_names_the_workers_share_of_the_time_to_first_token(
    sim_worker: SimWorker, proxy_factory: ProxyFactory,
) -> None:
    """A worker that stalls 0.3 s before its first token: the proxy's Server-Timing counts
    that stall (less the moment the proxy takes to send it on), and no more than the client
    waited; the same for a non-streamed answer."""
    proxy = proxy_factory([("w", sim_worker.url)])
    wait_until(lambda: proxy_knows_max_len(proxy), 10, "the proxy's first scrape")
    endpoint, body = request_body(0)

    def first_token() -> tuple[float, float]:
        started = time.monotonic()
        with fetch.stream("POST", f"{proxy.url}{endpoint}", timeout=30,
                          json={**body, "stream": True, "max_tokens": 2}) as resp:
            assert resp.status == 200
            for piece in resp.iter_bytes():
                if b'"token_ids"' in piece:
                    return upstream_ms(resp.headers), (time.monotonic() - started) * 1e3
        raise AssertionError("no token")

    def whole() -> tuple[float, float]:
        started = time.monotonic()
        resp = fetch.post(f"{proxy.url}{endpoint}", json={**body, "max_tokens": 2}, timeout=30)
        assert resp.status == 200
        return upstream_ms(resp.headers), (time.monotonic() - started) * 1e3

    for send in (first_token, whole):
        worker_ms, client_ms = through_a_stall(proxy, sim_worker, send, 0.3)
        assert 250 <= worker_ms <= client_ms


@contextmanager
def threaded_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve `handler` on a free loopback port in threads; its URL; stopped on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def fake_daemon(weights: dict[str, float]) -> Iterator[tuple[str, list[Any]]]:
    """A stand-in canary daemon: GET /workers from `weights`, POST /report recorded."""
    reports: list[Any] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"workers": [{"name": n, "weight": w}
                                           for n, w in weights.items()]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            reports.append(json.loads(self.rfile.read(length)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with threaded_server(Handler) as url:
        yield url, reports


LEVEL_WEIGHTS = {
    0: (1.0, 1.0, 1.0, 1.0),
    1: (1.0, 1.0, 1.0, 0.0),
    2: (1.0, 1.0, 0.0, 0.0),
    3: (1.0, 0.0, 0.0, 0.0),
    4: (0.5, 0.0, 0.0, 0.0),
}


def test_priority_shedding_order_under_each_degradation_level(
    sim_worker: SimWorker, proxy_factory: ProxyFactory,
) -> None:
    """With daemon weights giving levels 0-4: best_effort shed first, then standard; premium kept."""
    names = ["d0", "d1", "d2", "d3"]
    weights = dict.fromkeys(names, 1.0)
    with fake_daemon(weights) as (daemon_url, _):
        proxy = proxy_factory([(n, sim_worker.url) for n in names], health_url=daemon_url)
        seen: dict[int, dict[str, int]] = {}
        for level, values in LEVEL_WEIGHTS.items():
            weights.update(zip(names, values, strict=True))
            wait_until(lambda level=level: fetch.get(f"{proxy.url}/health", timeout=5)
                       .json()["degradation_level"] == level, 10, f"degradation level {level}")
            seen[level] = {}
            for tier in ("premium", "standard", "best_effort"):
                resp = fetch.post(f"{proxy.url}/v1/completions", timeout=30,
                                  headers={"x-ftctl-priority": tier},
                                  json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                seen[level][tier] = resp.status
                if resp.status == 503:
                    assert resp.headers["retry-after"] == "1"
    assert seen == {
        0: {"premium": 200, "standard": 200, "best_effort": 200},
        1: {"premium": 200, "standard": 200, "best_effort": 503},
        2: {"premium": 200, "standard": 200, "best_effort": 503},
        3: {"premium": 200, "standard": 503, "best_effort": 503},
        4: {"premium": 200, "standard": 503, "best_effort": 503},
    }
    metrics = fetch.get(f"{proxy.url}/metrics", timeout=5).text
    assert 'ftctl_proxy_rejected_requests_total{priority="best_effort",reason="degradation_level_1"}' \
        in metrics


def test_overload_answers_503_then_a_runtime_threshold_change_admits(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """KV cache above the threshold under a load loop: 503 + body; raising it admits again."""
    worker = sim_worker_factory(name="b0", model_config="ftctl-sim-tiny-small-cache")
    set_fault(worker, {"kind": "slow", "delay_ms": 20})
    proxy = proxy_factory([("b0", worker.url)],
                          busy={"active_decode_blocks_threshold": 0.3})
    # 4 x (96 + 100) tokens overfill the 24-block (384-token) cache of this preset.
    load = {"model": MODEL, "prompt": "fault tolerance " * 6, "max_tokens": 100,
            "temperature": 0}
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    answers: list[Reply] = []

    def probe() -> bool:
        answers.append(fetch.post(f"{proxy.url}/v1/completions", json=small, timeout=30))
        return answers[-1].status == 503

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fetch.post, f"{worker.url}/v1/completions", json=load,
                               timeout=60) for _ in range(4)]
        wait_until(probe, 20, "the proxy to report all workers busy")  # bounded load loop
        rejected = answers[-1]
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json() == {
            "message": "Service temporarily unavailable: All workers are busy, please retry "
                       "later", "type": "service_unavailable", "code": 503}
        denied = fetch.post(f"{proxy.url}/busy_threshold", timeout=5,
                            json={"model": MODEL, "active_decode_blocks_threshold": 1.0})
        assert denied.status == 401
        changed = fetch.post(f"{proxy.url}/busy_threshold", timeout=5,
                             headers={"Authorization": f"Bearer {PROXY_ADMIN_TOKEN}"},
                             json={"model": MODEL, "active_decode_blocks_threshold": 1.0})
        assert changed.status == 200
        assert fetch.get(f"{proxy.url}/busy_threshold?model={MODEL}",
                         timeout=5).json()["active_decode_blocks_threshold"] == 1.0
        assert fetch.post(f"{proxy.url}/v1/completions", json=small, timeout=30) \
            .status == 200
        set_fault(worker, {"kind": "clear"})
        for future in futures:
            future.result(timeout=60)


@contextmanager
def garbage_worker(mode: str) -> Iterator[str]:
    """A broken 'worker': an HTML 502 page, SSE with bad JSON, or an endless tokenless stream."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if mode == "html502":
                body = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
                self.send_response(502)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            if mode == "bad_json":
                self.wfile.write(b'data: {"choices": [{"text": "oops"\n\ndata: [DONE]\n\n')
                return
            deadline = time.monotonic() + 30  # endless, but bounded for the test's sake
            try:
                while time.monotonic() < deadline:
                    self.wfile.write(b": keep-alive\n\ndata: {\"choices\": []}\n\n")
                    self.wfile.flush()
                    time.sleep(0.01)
            except OSError:
                return

        def log_message(self, *args: Any) -> None:
            pass

    with threaded_server(Handler) as url:
        yield url


@pytest.mark.parametrize("mode", ["html502", "bad_json", "endless"])
def test_garbage_from_a_worker_is_a_failure_never_output(
    shared_sim_worker: SimWorker, proxy_factory: ProxyFactory, mode: str,
) -> None:
    """HTML 502 pages, bad JSON and endless tokenless streams are failures, not client output."""
    endpoint, body = request_body(2)
    expected = reference(shared_sim_worker, endpoint, body)
    with garbage_worker(mode) as bad_url:
        proxy = proxy_factory([("bad", bad_url), ("good", shared_sim_worker.url)],
                              stall_timeout_s=1.0, breaker_threshold=100)
        for _ in range(4):  # round-robin: at least two of them start on the bad worker
            got = stream(proxy, endpoint, body)
            assert got.error is None
            assert (got.ids, got.text) == expected
    metrics = fetch.get(f"{proxy.url}/metrics", timeout=5).text
    assert 'ftctl_migrations_total{method="retry",source_group="bad",target_group="good"}' \
        in metrics


def token_texts(worker: SimWorker, endpoint: str, body: dict[str, Any]) -> list[str]:
    """The text of each token of the fault-free run, streamed straight from a worker."""
    payload = {**body, "stream": True}
    with fetch.stream("POST", f"{worker.url}{endpoint}", json=payload, timeout=60) as resp:
        raw = resp.read()
    texts = []
    for event in iter_sse_events([raw]):
        if event.is_done:
            continue
        for choice in json.loads(event.data)["choices"]:
            delta = choice.get("delta")
            texts.append((delta.get("content") or "") if delta is not None else choice["text"])
    return texts


def straddling_stop(texts: list[str]) -> tuple[str, int]:
    """A stop string whose first occurrence ends two tokens after token k begins; (stop, k)."""
    full = "".join(texts)
    offset = 0
    for k, text in enumerate(texts[:-2]):
        offset += len(text)
        if k < 6 or not text or not texts[k + 1] or not texts[k + 2]:
            continue
        stop = text[-2:] + texts[k + 1] + texts[k + 2][:1]
        if len(stop) >= 3 and full.find(stop) == offset - len(text[-2:]):
            return stop, k
    msg = f"no usable stop string in {full!r}"
    raise AssertionError(msg)


@pytest.mark.parametrize("spec", [0, 3], ids=["completions-greedy", "chat-seeded"])
def test_stop_string_straddling_a_sigkill_stops_like_the_unbroken_run(
    sim_worker_factory: Any, proxy_factory: ProxyFactory, spec: int,
) -> None:
    """Worker SIGKILLed inside a stop string: the output stops exactly where it stops unbroken."""
    workers = [sim_worker_factory(name=f"s{i}") for i in range(2)]
    proxy = proxy_factory([(w.name, w.url) for w in workers])
    by_name = {w.name: w for w in workers}
    endpoint, body = request_body(spec)
    body = {**body, "max_tokens": 48}
    stop, k = straddling_stop(token_texts(workers[0], endpoint, body))
    ids, text = reference(workers[0], endpoint, {**body, "stop": [stop]})
    for worker in workers:
        set_fault(worker, {"kind": "slow", "delay_ms": 60})
    # Killed once tokens 0..k are out (the stop string's first characters among them).
    kill_inside_the_stop, killed = after_tokens(k + 1, lambda name: by_name[name].kill())
    got = stream(proxy, endpoint, {**body, "stop": [stop]}, on_chunk=kill_inside_the_stop)
    assert killed, "the stream ended before the kill"
    assert got.migrated >= 1
    assert got.error is None
    assert got.finish == "stop"
    assert (got.ids, got.text) == (ids, text)
    assert stop not in got.text
    assert got.usage is not None
    assert got.usage["completion_tokens"] == len(ids)


def calibration_file(path: Path, setup_s: float) -> Path:
    """A calibration (`ftctl migrate calibrate` format) whose KV moves cost `setup_s` each
    and whose re-prefill costs 50 ms a token: a continuation of ~40 tokens models 2 s, so
    the export's budget (twice that, at most the stall timeout) is the stall timeout."""
    doc = {"version": 1, "worker": "a", "peer": "b", "model": MODEL, "layers": 2,
           "kv_heads": 2, "head_dim": 32, "dtype_bytes": 4, "block_size": 16,
           "prefill": {"fixed_s": 0.0, "per_token_s": 0.05, "per_token2_s": 0.0},
           "transfer": {"setup_s": setup_s, "bandwidth_bytes_per_s": 1e9}}
    path.write_text(json.dumps(doc))
    return path


def migration_count(proxy: ProxyProcess, method: str) -> float:
    """ftctl_migrations_total summed over groups for one method."""
    total = 0.0
    for line in fetch.get(f"{proxy.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ftctl_migrations_total{") and f'method="{method}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize(("setup_s", "method"), [(1e-4, "kv"), (10.0, "reprefill")])
def test_stalled_worker_is_migrated_by_kv_when_the_calibration_says_so(
    sim_worker_factory: Any, proxy_factory: ProxyFactory, tmp_path: Path,
    setup_s: float, method: str,
) -> None:
    """A live worker that stalls mid-stream: its KV moves (or it re-prefills), output unchanged.

    The stall timeout (2 s) bounds the export's budget: at 0.5 s an export from a busy
    machine's sim missed it and fell back to re-prefill (3 of 4 runs at load ~10)."""
    workers = [sim_worker_factory(name=f"v{i}") for i in range(2)]
    by_name = {w.name: w for w in workers}
    proxy = proxy_factory([(w.name, w.url) for w in workers],
                          worker_admin_token=workers[0].admin_token, stall_timeout_s=2.0,
                          calibration=str(calibration_file(tmp_path / "cal.json", setup_s)))
    for spec in (0, 2):  # greedy, then seeded sampling
        endpoint, body = request_body(spec)
        body = {**body, "max_tokens": 32}
        ids, text = reference(workers[0], endpoint, body)
        for worker in workers:
            set_fault(worker, {"kind": "slow", "delay_ms": 30})
        stall_after_six, stalled = after_tokens(
            6, lambda name: set_fault(by_name[name], {"kind": "slow", "delay_ms": 5000}))
        before = migration_count(proxy, method)
        got = stream(proxy, endpoint, body, on_chunk=stall_after_six)
        assert stalled, "the stream ended before the stall"
        assert got.error is None
        assert (got.ids, got.text) == (ids, text)
        assert got.migrated == 1
        assert migration_count(proxy, method) == before + 1
        set_fault(by_name[stalled[0]], {"kind": "clear"})


def test_bad_calibration_file_exits_2_naming_the_file_and_key(tmp_path: Path) -> None:
    """--calibration with an invalid file: one line naming file and key, exit 2, no server."""
    bad = tmp_path / "cal.yaml"
    bad.write_text("version: 1\nworker: a\npeer: b\nmodel: m\nlayers: zero\n")
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(yaml.safe_dump({
        "cluster": "c", "workers": [{"name": "w", "url": "http://127.0.0.1:9", "model": MODEL}],
        "proxy": {"listen": "127.0.0.1:0"},
    }))
    done = subprocess.run(
        [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "proxy",
         "--calibration", str(bad)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"{bad}:5" in lines[0]
    assert "layers" in lines[0]
    assert "serving" not in done.stderr


PROMISE_PROMPTS = ("Tokens must not be lost", "A stream that survives",
                   "Grüße, ça va? 日本語のテキスト")


def test_streams_cut_at_any_point_after_a_dead_worker_continue_identically(
    sim_worker_factory: Any, proxy_factory: ProxyFactory,
) -> None:
    """Issue 29's promise on the BPE sim: three workers (seed 11), one dead, then the serving
    one cuts every stream after k tokens, for k across the whole answer: each greedy
    text-only stream (ASCII and multi-byte prompts) is the uninterrupted run, character for
    character, as it goes on from token ids, never from re-sent text."""
    workers = [sim_worker_factory(name=f"t{i}", seed=11) for i in range(3)]
    proxy = proxy_factory([(w.name, w.url) for w in workers], breaker_threshold=100000)
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    expected = {p: reference(workers[1], "/v1/completions",
                             {**body, "prompt": p, "return_token_ids": True})[1]
                for p in PROMISE_PROMPTS}
    workers[0].kill()  # the dead one is tried first by some requests: a retry, then the cut
    retried = 0
    for cut in (1, 2, 3, 5, 8, 13, 20, 31, 47, 63):
        set_fault(workers[1], {"kind": "disconnect", "after_tokens": cut})
        for prompt in PROMISE_PROMPTS:
            for _ in range(6):  # until t1, which cuts, serves the start (routing rotates)
                got = stream(proxy, "/v1/completions", {**body, "prompt": prompt})
                assert got.error is None, (cut, prompt, got.error)
                assert got.text == expected[prompt], (cut, prompt)
                served = got.headers.get("x-ftctl-worker", "").split(",")
                if served[-1] == "t1":
                    retried += served[0] == "t0"
                    break
            else:
                pytest.fail(f"no stream began on t1 in 6 tries (cut {cut})")
    assert retried, "no stream was retried from the dead worker before the cut"


def test_sighup_reloads_the_inventory_without_dropping_a_stream(
    sim_worker_factory: Any, proxy_factory: ProxyFactory, tmp_path: Path,
) -> None:
    """Issue 29: SIGHUP cut 12 of 12 streams. Now 12 streams under way all finish whole; an
    inventory that adds a worker takes effect (requests reach it); a broken file keeps the
    workers as they were, with one log line."""
    first, second = (sim_worker_factory(name=n) for n in ("h0", "h1"))
    set_fault(first, {"kind": "slow", "delay_ms": 20})
    proxy = proxy_factory([("h0", first.url)])
    assert proxy.inventory is not None
    path = proxy.inventory
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    with ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(stream, proxy, "/v1/completions", body) for _ in range(12)]
        wait_until(lambda: gauge(first.url, "vllm:num_requests_running") >= 12, 20,
                   "12 streams under way")
        proxy.proc.send_signal(signal.SIGHUP)
        got = [future.result(timeout=60) for future in streams]
    assert proxy.proc.poll() is None
    assert all(g.error is None and len(g.text) > 0 and g.done for g in got)
    assert len({g.text for g in got}) == 1
    doc = yaml.safe_load(path.read_text())
    doc["workers"].append({"name": "h1", "url": second.url, "model": MODEL})
    path.write_text(yaml.safe_dump(doc))
    proxy.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "h1" in fetch.get(f"{proxy.url}/health", timeout=5).json()["workers"],
               10, "the reloaded inventory")
    served = [stream(proxy, "/v1/completions", body) for _ in range(4)]
    assert all(g.error is None for g in served)
    assert "h1" in {g.headers.get("x-ftctl-worker") for g in served}
    path.write_text("workers: [unclosed\n")
    proxy.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "inventory not reloaded" in proxy.log_text(), 10, "the refusal")
    assert set(fetch.get(f"{proxy.url}/health", timeout=5).json()["workers"]) == {"h0", "h1"}
    assert proxy.log_text().count("inventory not reloaded") == 1


def _vm(pid: int, key: str) -> float:
    """A /proc/PID/status figure (VmRSS, VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _SlowRefusal(BaseHTTPRequestHandler):
    """A worker that reads a generation, waits 2 s, and refuses it (400); no /metrics."""

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if b"ping" not in self.path.encode():
            time.sleep(2.0)
        data = b'{"error": {"message": "prompt too long", "code": 400}}'
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_parsed_requests_count_in_the_buffer_budget(proxy_factory: ProxyFactory) -> None:
    """Issue 29 case 7: 17 concurrent 14 MiB token-id prompts took a proxy with
    max_buffered_mib 256 to 825 MB: a request's parsed form (~7x its bytes) was not counted.
    Now it is: with a 64 MiB budget, 17 concurrent 2 MiB id prompts to a slow worker get
    503 + Retry-After past the budget, and the proxy's peak memory grows by about the
    budget, not by all 17 parsed prompts (~250 MiB)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowRefusal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        proxy = proxy_factory([("m0", url)], max_buffered_mib=64, stall_timeout_s=10.0,
                              busy={"active_prefill_tokens_threshold": 10**9})
        ids = list(range(100_000, 100_000 + 300_000))  # ~2.1 MiB of JSON
        body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
        base = _vm(proxy.proc.pid, "VmRSS")

        def post() -> Reply:
            return fetch.post(f"{proxy.url}/v1/completions", content=body, timeout=60,
                              headers={"Content-Type": "application/json"})

        with ThreadPoolExecutor(17) as pool:
            answers = list(pool.map(lambda _: post(), range(17)))
        grown = _vm(proxy.proc.pid, "VmHWM") - base
    finally:
        server.shutdown()
        server.server_close()
    refused = [r for r in answers if r.status == 503]
    assert {r.status for r in answers} == {400, 503}, [r.status for r in answers]
    assert all(r.headers.get("retry-after") for r in refused)
    assert grown < 64 * 1.6, f"the proxy grew {grown:.0f} MiB past its 64 MiB budget"
