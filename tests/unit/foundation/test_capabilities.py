"""Capability discovery: each probe's answer kinds, the cache, restarts, the CLI, hostile workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner

from dynamo_ftctl.capabilities import (
    Capabilities,
    CapabilityCache,
    load_metric_from_metrics,
    probe_capabilities,
    start_time_from_metrics,
)
from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.http1 import MockTransport, Reply, Request
from dynamo_ftctl.inventory import Worker, parse_inventory
from tests.integration.proxy.test_proxy_sim import threaded_server
from tests.loopback import Server

WORKER = Worker(name="w1", url="http://w1:8000", model="m")

# Declarative answers of a vLLM-like worker, by (method, path); tests replace single routes.
CHUNK = b'data: {"choices":[{"index":0,"text":"x","token_ids":[7],"prompt_token_ids":[1,2]}]}\n\n'
VLLM: dict[tuple[str, str], tuple[int, bytes]] = {
    ("POST", "/v1/completions"): (200, CHUNK + b"data: [DONE]\n\n"),
    ("POST", "/v1/chat/completions"): (
        200, b'data: {"prompt_token_ids":[1],"choices":[{"delta":{},"token_ids":[7]}]}\n\n'
             b"data: [DONE]\n\n"),
    ("POST", "/tokenize"): (200, b'{"tokens":[1,2],"count":2,"max_model_len":4096}'),
    ("GET", "/health"): (200, b""),
    ("GET", "/metrics"): (200, b"# HELP x\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n"
                               b"process_start_time_seconds 1.7e9\n"),
    ("GET", "/is_sleeping"): (200, b'{"is_sleeping":false}'),
    ("GET", "/v1/models"): (200, b'{"data":[{"id":"m","owned_by":"vllm","max_model_len":4096}]}'),
    ("GET", "/version"): (200, b'{"version":"0.11.0"}'),
}
STRICT_400 = (400, b'{"detail":[{"type":"extra_forbidden","loc":["body","return_token_ids"]}]}')

Answer = tuple[int, bytes] | Callable[[], Any]


class FakeWorker(MockTransport):
    """A `MockTransport` answering from a route table; records each call; unknown routes
    are 404."""

    def __init__(self, routes: Mapping[tuple[str, str], Answer] | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(self.answer)
        self.routes = dict(VLLM if routes is None else routes)
        self.headers = {name.lower(): value for name, value in (headers or {}).items()}
        self.calls: list[tuple[str, str, bytes, dict[str, str]]] = []

    async def answer(self, request: Request) -> Reply:
        self.calls.append((request.method, request.url, request.body, dict(request.headers)))
        path = urlsplit(request.url).path
        if path.startswith("/admin/kv/"):
            path = "/admin/kv/{id}"
        answer = self.routes.get((request.method, path), (404, b'{"detail":"Not Found"}'))
        if callable(answer):
            answer = await answer()
        status, data = answer
        return Reply(status, data, self.headers)

    def body_of(self, path: str) -> dict[str, Any]:
        return next(json.loads(b) for _, u, b, _ in self.calls if u.endswith(path))


def probe(transport: Any, **kwargs: Any) -> Capabilities:
    return asyncio.run(probe_capabilities(WORKER, transport=transport, admin_token="t", **kwargs))


def test_vllm_like_worker_supports_everything_but_kv_export() -> None:
    """A vLLM-like worker: token ids on both endpoints, tokenize, health, metrics, sleep, models."""
    worker = FakeWorker(headers={"Server": "uvicorn"})
    caps = probe(worker)
    assert caps.reachable
    assert caps.error is None
    assert (caps.token_ids, caps.prompt_token_ids, caps.chat_token_ids) == (True, True, True)
    assert caps.strict_fields is False
    assert caps.tokenize
    assert caps.health
    assert caps.metrics
    assert caps.sleep
    assert caps.asleep is False
    assert caps.load_metric == "vllm"
    assert caps.kv_usage_metric == "vllm:kv_cache_usage_perc"
    assert caps.process_start_time == 1.7e9
    assert caps.kv_export is False  # a plain router 404
    assert (caps.max_model_len, caps.models) == (4096, ("m",))
    assert caps.server == "vllm 0.11.0 (uvicorn)"


def test_the_generation_probe_asks_for_one_greedy_streamed_token_with_ids() -> None:
    """The completion probe sends return_token_ids, max_tokens 1, temperature 0, stream, model."""
    worker = FakeWorker()
    probe(worker)
    body = worker.body_of("/v1/completions")
    assert body["return_token_ids"] is True
    assert (body["max_tokens"], body["temperature"], body["stream"], body["model"]) == (
        1, 0, True, "m")
    assert worker.body_of("/v1/chat/completions")["messages"][0]["role"] == "user"


def test_chunks_without_ids_mean_no_token_ids() -> None:
    """A server that ignores return_token_ids: token_ids False, and it is not strict."""
    worker = FakeWorker({**VLLM, ("POST", "/v1/completions"): (
        200, b'data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n')})
    caps = probe(worker)
    assert (caps.token_ids, caps.prompt_token_ids, caps.strict_fields) == (False, False, False)


@pytest.mark.parametrize("status", [400, 422])
def test_an_error_naming_the_field_means_strict_fields(status: int) -> None:
    """400/422 naming return_token_ids: no token ids, and the server refuses unknown fields."""
    worker = FakeWorker({**VLLM, ("POST", "/v1/completions"): (status, STRICT_400[1]),
                       ("POST", "/v1/chat/completions"): (status, STRICT_400[1])})
    caps = probe(worker)
    assert (caps.token_ids, caps.chat_token_ids, caps.strict_fields) == (False, False, True)


def test_an_error_not_naming_the_field_is_unknown() -> None:
    """A 400 about something else (wrong model) says nothing about token ids."""
    worker = FakeWorker({**VLLM, ("POST", "/v1/completions"): (400, b'{"error":"no model m"}')})
    caps = probe(worker)
    assert caps.token_ids is None
    assert "POST /v1/completions: HTTP 400" in caps.notes


def test_a_plain_json_completion_is_read_too() -> None:
    """A server that answers a stream request with one JSON body is judged on that body."""
    worker = FakeWorker({**VLLM, ("POST", "/v1/completions"): (
        200, b'{"choices":[{"text":"x","token_ids":[3]}],"prompt_token_ids":[1]}')})
    caps = probe(worker)
    assert (caps.token_ids, caps.prompt_token_ids) == (True, True)


def test_a_bare_server_says_no_to_each_missing_route() -> None:
    """Only /v1 routes: tokenize, health, metrics, sleep, kv_export are no, not unknown."""
    routes = {k: v for k, v in VLLM.items() if k[1].startswith("/v1/")}
    caps = probe(FakeWorker(routes))
    assert (caps.tokenize, caps.health, caps.metrics, caps.sleep, caps.kv_export) == (
        False, False, False, False, False)
    assert caps.load_metric == "none"
    assert caps.process_start_time is None


def test_old_vllm_metrics_and_no_load_metric() -> None:
    """The gauge's old name is the old family; a page with neither is "none"."""
    assert load_metric_from_metrics(b"vllm:gpu_cache_usage_perc{a=\"b\"} 0.5\n") == "vllm_old"
    assert load_metric_from_metrics(b"vllm:kv_cache_usage_perc 0.5\n") == "vllm"
    assert load_metric_from_metrics(b"# HELP vllm:kv_cache_usage_perc x\nother 1\n") == "none"
    assert load_metric_from_metrics(b"vllm:kv_cache_usage_perc_total 1\n") == "none"


def test_start_time_parsing_refuses_garbage() -> None:
    """process_start_time_seconds is read with or without labels; garbage and NaN are None."""
    assert start_time_from_metrics(b"process_start_time_seconds 1.5e9\n") == 1.5e9
    assert start_time_from_metrics(b'process_start_time_seconds{pid="1"} 12\n') == 12.0
    assert start_time_from_metrics(b"process_start_time_seconds NaN\n") is None
    assert start_time_from_metrics(b"process_start_time_seconds abc\n") is None
    assert start_time_from_metrics(b"xprocess_start_time_seconds 1\n") is None


def test_kv_export_route_found_with_the_sim_404_and_token() -> None:
    """The sim's export route answers NotFoundError for an unknown id: kv_export, token sent."""
    worker = FakeWorker({**VLLM, ("GET", "/admin/kv/{id}"): (
        404, b'{"error":{"message":"no request","type":"NotFoundError","param":null}}')})
    caps = probe(worker)
    assert caps.kv_export is True
    (call,) = [c for c in worker.calls if "/admin/kv/" in c[1]]
    assert call[0] == "GET"
    assert "abort" not in call[1]
    assert call[3]["Authorization"] == "Bearer t"


@pytest.mark.parametrize(("status", "expected"), [(401, None), (403, False), (500, None)])
def test_kv_export_when_the_admin_api_refuses(status: int, expected: bool | None) -> None:
    """401 (token needed) is unknown; 403 (admin API disabled) is no; a 500 is unknown."""
    worker = FakeWorker({**VLLM, ("GET", "/admin/kv/{id}"): (status, b'{"error":{}}')})
    assert probe(worker).kv_export is expected


def test_a_sleeping_worker_has_sleep_and_unknown_health() -> None:
    """/health 503 while asleep: the route is there but says nothing now; asleep is recorded."""
    worker = FakeWorker({**VLLM, ("GET", "/health"): (503, b"{}"),
                       ("GET", "/is_sleeping"): (200, b'{"is_sleeping":true}')})
    caps = probe(worker)
    assert (caps.health, caps.sleep, caps.asleep) == (None, True, True)


def test_garbage_answers_leave_fields_unknown_or_no() -> None:
    """Garbage JSON, a JSON nesting bomb and non-lists never raise; fields stay unknown or no."""
    bomb = b"[" * 200_000
    routes = {
        ("POST", "/v1/completions"): (200, b"data: {not json\n\n"),
        ("POST", "/v1/chat/completions"): (200, bomb),
        ("POST", "/tokenize"): (200, b'{"tokens":"abc"}'),
        ("GET", "/health"): (200, b"\xff\xfe"),
        ("GET", "/metrics"): (200, b"\x00" * 1000),
        ("GET", "/is_sleeping"): (200, bomb),
        ("GET", "/v1/models"): (200, b'{"data":[{"id":5},"x",{"id":"m","max_model_len":true}]}'),
        ("GET", "/version"): (200, b"[1]"),
    }
    caps = probe(FakeWorker(routes))
    assert caps.reachable
    assert (caps.token_ids, caps.chat_token_ids) == (None, None)
    assert caps.tokenize is False
    assert caps.sleep is False
    assert caps.load_metric == "none"
    assert caps.models == ("m",)
    assert caps.max_model_len is None
    assert caps.server is None


def test_a_body_over_the_cap_is_refused() -> None:
    """A transport that returns more than MAX_PROBE_BYTES: that probe's answer is thrown away."""
    huge = b"vllm:kv_cache_usage_perc 1\n" + b"#" * (3 * 1024 * 1024)
    caps = probe(FakeWorker({**VLLM, ("GET", "/metrics"): (200, huge)}))
    assert caps.metrics is None
    assert any("body over" in n for n in caps.notes)


def test_an_unreachable_worker_has_an_error_and_no_fields() -> None:
    """Every exchange refused: error set, every capability unknown, nothing raised."""
    async def refused(_: Request) -> Reply:
        raise ConnectionRefusedError("connection refused")

    caps = probe(MockTransport(refused))
    assert not caps.reachable
    assert caps.error is not None
    assert caps.error.startswith("unreachable: ")
    assert "connection refused" in caps.error
    assert caps.token_ids is None
    assert caps.models == ()


def test_a_transport_that_ignores_its_timeout_is_cut_at_the_deadline() -> None:
    """A transport that never returns: each probe gives up after timeout_s; the worker is
    unreachable."""
    async def hang(_: Request) -> Reply:
        await asyncio.Event().wait()
        raise AssertionError

    caps = probe(MockTransport(hang), timeout_s=0.05)
    assert not caps.reachable
    assert "no answer within 0.05 s" in (caps.error or "")


def test_one_slow_route_does_not_hide_the_others() -> None:
    """A hung /tokenize leaves tokenize unknown while every other probe answers."""
    async def hang() -> Any:
        await asyncio.Event().wait()

    caps = probe(FakeWorker({**VLLM, ("POST", "/tokenize"): hang}), timeout_s=0.05)
    assert caps.reachable
    assert caps.tokenize is None
    assert caps.health is True


def test_probed_at_and_elapsed_come_from_the_clock() -> None:
    """probed_at is the clock's wall time (the seam for tests)."""
    clock = FakeClock(start=100.0)
    caps = probe(FakeWorker(), clock=clock)
    assert caps.probed_at == clock.wall()


# ---------------------------------------------------------------------------
# The cache


class CountingWorker(FakeWorker):
    """Counts /v1/models calls (one per probe) and can hold them until released."""

    def __init__(self, start_time: float = 1.0) -> None:
        super().__init__()
        self.probes = 0
        self.release = asyncio.Event()
        self.hold = False
        self.set_start_time(start_time)

        async def models() -> tuple[int, bytes]:
            self.probes += 1
            if self.hold:
                await self.release.wait()
            return VLLM[("GET", "/v1/models")]

        self.routes[("GET", "/v1/models")] = models

    def set_start_time(self, value: float) -> None:
        self.routes[("GET", "/metrics")] = (200, f"process_start_time_seconds {value}\n".encode())


def test_concurrent_probes_of_one_worker_share_one_exchange() -> None:
    """Ten callers at once: one probe in flight, all get the same answer, then it is cached."""
    async def main() -> None:
        worker = CountingWorker()
        worker.hold = True
        cache = CapabilityCache(transport=worker)
        callers = [asyncio.ensure_future(cache.probe(WORKER)) for _ in range(10)]
        await asyncio.sleep(0)
        worker.release.set()
        results = await asyncio.gather(*callers)
        assert worker.probes == 1
        assert all(r is results[0] for r in results)
        assert await cache.probe(WORKER) is results[0]
        assert worker.probes == 1
        assert cache.get("w1") is results[0]

    asyncio.run(main())


def test_one_cancelled_caller_does_not_cancel_the_shared_probe() -> None:
    """A caller that gives up leaves the in-flight probe to the others."""
    async def main() -> None:
        worker = CountingWorker()
        worker.hold = True
        cache = CapabilityCache(transport=worker)
        first = asyncio.ensure_future(cache.probe(WORKER))
        second = asyncio.ensure_future(cache.probe(WORKER))
        await asyncio.sleep(0.01)
        first.cancel()
        worker.release.set()
        assert (await second).reachable
        assert worker.probes == 1

    asyncio.run(main())


def test_invalidate_makes_the_next_probe_ask_again() -> None:
    """invalidate (the proxy saw the worker fail) drops the entry; the next probe re-asks."""
    async def main() -> None:
        worker = CountingWorker()
        cache = CapabilityCache(transport=worker)
        await cache.probe(WORKER)
        cache.invalidate("w1")
        assert cache.get("w1") is None
        await cache.probe(WORKER)
        assert worker.probes == 2

    asyncio.run(main())


def test_a_probe_in_flight_when_invalidated_is_not_stored() -> None:
    """An answer begun before the failure is returned to its callers but not cached."""
    async def main() -> None:
        worker = CountingWorker()
        worker.hold = True
        cache = CapabilityCache(transport=worker)
        stale = asyncio.ensure_future(cache.probe(WORKER))
        await asyncio.sleep(0.01)
        cache.invalidate("w1")
        fresh = asyncio.ensure_future(cache.probe(WORKER))
        await asyncio.sleep(0.01)
        worker.release.set()
        old, new = await stale, await fresh
        assert old is not new
        assert cache.get("w1") is new
        assert worker.probes == 2

    asyncio.run(main())


def test_a_new_start_time_is_a_restart() -> None:
    """note_start_time with the probed value changes nothing; a new value invalidates."""
    async def main() -> None:
        worker = CountingWorker(start_time=1.0)
        cache = CapabilityCache(transport=worker)
        caps = await cache.probe(WORKER)
        assert caps.process_start_time == 1.0
        assert cache.note_start_time("w1", 1.0) is False
        assert cache.get("w1") is caps
        assert cache.note_start_time("w1", 2.0) is True
        assert cache.get("w1") is None
        worker.set_start_time(2.0)
        await cache.probe(WORKER)
        assert worker.probes == 2
        assert cache.note_start_time("w1", 2.0) is False

    asyncio.run(main())


def test_start_times_noted_before_any_probe_still_detect_a_restart() -> None:
    """The proxy's scrape may note a start time first; a later different one is a restart."""
    cache = CapabilityCache(transport=FakeWorker())
    assert cache.note_start_time("w9", 5.0) is False
    assert cache.note_start_time("w9", 6.0) is True


def test_an_unreachable_answer_is_kept_only_briefly() -> None:
    """An unreachable worker is re-probed after retry_unreachable_s (fake clock)."""
    async def refused(_: Request) -> Reply:
        raise ConnectionRefusedError("refused")

    async def main() -> None:
        clock = FakeClock()
        cache = CapabilityCache(transport=MockTransport(refused), clock=clock,
                                retry_unreachable_s=5.0)
        caps = await cache.probe(WORKER)
        assert cache.get("w1") is caps
        clock.advance(5.0)
        assert cache.get("w1") is None

    asyncio.run(main())


def test_probe_all_probes_workers_concurrently() -> None:
    """probe_all runs every worker's probe at once (all held, then all released)."""
    async def main() -> None:
        worker = CountingWorker()
        worker.hold = True
        cache = CapabilityCache(transport=worker)
        workers = [Worker(name=f"w{i}", url=f"http://w{i}:1", model="m") for i in range(5)]
        job = asyncio.ensure_future(cache.probe_all(workers))
        await asyncio.sleep(0.01)
        assert worker.probes == 5  # all five are waiting at once
        worker.release.set()
        assert [c.worker for c in await job] == [w.name for w in workers]
        assert set(cache.snapshot()) == {w.name for w in workers}

    asyncio.run(main())


# ---------------------------------------------------------------------------
# The default transport against hostile loopback servers


async def _hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    path = head.split(b" ")[1]
    if path == b"/metrics":  # an endless chunked body
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        while True:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
    elif path == b"/v1/models":  # a huge declared body, sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n")
        for _ in range(2000):
            writer.write(b"y" * 65536)
            await writer.drain()
    elif path == b"/health":  # a trickle: one byte at a time, never done
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        hangup = asyncio.ensure_future(reader.read())  # b"" once the client gives up
        hangup.add_done_callback(lambda f: f.cancelled() or f.exception())  # a reset is fine
        while not hangup.done():
            writer.write(b"z")
            await writer.drain()
            await asyncio.sleep(0.01)
    elif path == b"/version":  # never answers, until the client gives up
        await reader.read()
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nServer: evil\r\n\r\ngarbage")
        await writer.drain()


@pytest.mark.parametrize("client", ["default", "through"])
def test_hostile_worker_over_real_sockets_is_bounded(client: str) -> None:
    """Endless, huge, trickling and silent answers: the default client and the proxy's
    `http1.Client` stop each in time."""
    from dynamo_ftctl.http1 import Client

    async def main() -> tuple[Capabilities, float]:
        async with Server(_hostile) as server, contextlib.AsyncExitStack() as stack:
            worker = Worker(name="evil", url=server.url, model="m")
            loop = asyncio.get_running_loop()
            start = loop.time()
            transport = None
            if client == "through":
                transport = Client()
                stack.push_async_callback(transport.close)
            caps = await probe_capabilities(worker, transport=transport, timeout_s=1.0)
            return caps, loop.time() - start

    caps, elapsed = asyncio.run(main())
    assert elapsed < 3.0
    assert caps.reachable
    assert (caps.metrics, caps.models, caps.health) == (None, (), None)
    assert len([n for n in caps.notes if n.startswith(("GET /metrics", "GET /v1/models"))]) == 2
    assert any(n.startswith("GET /version") for n in caps.notes)
    assert caps.token_ids is None
    assert caps.server == "(evil)"  # both hand the probe the headers


def test_default_fetch_reports_a_closed_port_as_unreachable() -> None:
    """No server: every probe refused, `error` says so, nothing raises."""
    worker = Worker(name="gone", url="http://127.0.0.1:9", model="m")
    caps = asyncio.run(probe_capabilities(worker, timeout_s=1.0))
    assert not caps.reachable
    assert "unreachable" in (caps.error or "")


# ---------------------------------------------------------------------------
# The CLI (a real loopback worker in a thread, so the command's own client is used)


class _Vllm(BaseHTTPRequestHandler):
    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        status, body = VLLM.get((method, self.path), (404, b'{"detail":"Not Found"}'))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def vllm_url() -> Iterator[str]:
    """A vLLM-like worker on a loopback port (a thread), shut down after the test."""
    with threaded_server(_Vllm) as url:
        yield url


def _inventory(tmp_path: Path, *urls: str) -> Path:
    workers = "".join(f"  - {{name: w{i}, url: '{u}', model: m}}\n" for i, u in enumerate(urls))
    path = tmp_path / "ftctl.yaml"
    path.write_text(f"cluster: t\nworkers:\n{workers}")
    parse_inventory(path.read_text(), path)
    return path


def test_cli_probe_table_exits_zero_when_all_answer(vllm_url: str, tmp_path: Path) -> None:
    """`inventory show --probe`: one row per worker, yes/no per capability, exit 0."""
    from dynamo_ftctl.cli.main import app

    path = _inventory(tmp_path, vllm_url)
    result = CliRunner().invoke(app, ["-i", str(path), "inventory", "show", "--probe",
                                      "--timeout", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("worker"))
    assert header.split()[:4] == ["worker", "token_ids", "chat_ids", "strict"]
    row = next(line for line in lines if line.startswith("w0 ")).split()
    assert row[1:10] == ["yes", "yes", "no", "yes", "yes", "yes", "vllm", "yes", "no"]
    assert "all answered" in result.stdout


def test_cli_probe_json_exits_three_when_one_is_unreachable(vllm_url: str, tmp_path: Path) -> None:
    """--json: one document with every worker; a dead worker makes the exit code 3."""
    from dynamo_ftctl.cli.main import app

    path = _inventory(tmp_path, vllm_url, "http://127.0.0.1:9")
    result = CliRunner().invoke(app, ["-i", str(path), "inventory", "show", "--probe", "--json",
                                      "--timeout", "2"])
    assert result.exit_code == 3, result.output
    doc = json.loads(result.stdout)
    by_name = {w["worker"]: w for w in doc["workers"]}
    assert by_name["w0"]["token_ids"] is True
    assert by_name["w0"]["error"] is None
    assert by_name["w0"]["max_model_len"] == 4096
    assert by_name["w1"]["error"].startswith("unreachable")
    assert by_name["w1"]["token_ids"] is None


def test_the_proxy_client_works_as_the_transport(vllm_url: str) -> None:
    """`http1.Client()` as the transport (the proxy's own client) probes a real socket."""
    from dynamo_ftctl.http1 import Client

    async def main() -> Capabilities:
        client = Client()
        try:
            worker = Worker(name="w0", url=vllm_url, model="m")
            return await probe_capabilities(worker, transport=client, timeout_s=2)
        finally:
            await client.close()

    caps = asyncio.run(main())
    assert caps.error is None
    assert caps.token_ids is True
    assert caps.load_metric == "vllm"
    assert caps.max_model_len == 4096
