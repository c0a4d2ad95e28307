"""Figures of issue #9 for the migrating proxy (`make bench` runs this).

1. Upstream client: a minimal forwarding hop with httpx vs aiohttp vs ftctl's
   http1 client (`dynamo_ftctl.http1`, the proxy's), same run.
2. Overhead: TTFT and end-to-end through `ftctl proxy` vs straight to the
   worker, 32 concurrent streams (goal: p50 TTFT ratio <= 1.10, <= 2 ms added):
   against trivial workers (below) and against a real `ftctl sim` engine (`--only
   sim`); with each, the proxy's share of every request's TTFT from its
   Server-Timing header (the client's TTFT less the worker's as the proxy saw it).
3. Throughput of the proxy pinned to one core with a trivial upstream (goal
   >= 2,000 non-streamed requests/s, >= 20,000 streamed tokens/s).
4. Migration stall: the extra client-visible gap at the failure point vs a
   re-prefill of the same length on an idle worker (goal <= re-prefill + 20 ms).

The upstream is a trivial scripted worker (this file, `upstream` mode: an
asyncio protocol + httptools on uvloop): it streams `max_tokens` tokens with
`--token-ms` between them and a prefill time of `--prefill-us` per prompt
token; a text prompt starting with FAIL is cut after `--fail-after` tokens
(continuations carry token ids, so they run on). The upstream is pinned to the
other core(s), the proxy to CPU 0. The client is `dynamo_ftctl.http1` on uvloop
too, in this process, which is not pinned: the scheduler puts it where there is
room, beside the upstream or beside the proxy, in the direct runs as in the
proxied ones (the real-engine figure pins it beside the engine, the proxy alone on
CPU 0; see `figure_overhead_sim`). (Pinned beside the upstream, one core carries client and worker
and becomes the limit: with 32 streams arriving at once the proxy then seemed
to add +5.8 ms of TTFT instead of +1.8 ms, same build, same hour.)
Usage: python benchmarks/proxy.py [--quick] [--only FIGURE] [--baseline-src DIR]
(DIR: another source tree, e.g. `git archive REV src | tar -x -C DIR`, whose proxy
is measured beside this one in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
T = TypeVar("T")


# ---------------------------------------------------------------- the trivial upstream

_SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n")
_SSE_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"

def token_event(ids: list[int], i: int, n: int) -> bytes:
    """The SSE event of token `i` of `n` (the first carries the prompt's ids)."""
    choice: dict[str, Any] = {"index": 0, "text": "a", "token_ids": [97],
                              "finish_reason": "length" if i == n - 1 else None}
    if i == 0:
        choice["prompt_token_ids"] = ids
    return b"data: " + json.dumps({"id": "x", "object": "text_completion", "model": "m",
                                   "choices": [choice]}).encode() + b"\n\n"


def run_framework_upstream(port: int, token_ms: float, prefill_us: float,
                           fail_after: int) -> None:
    """The trivial worker behind a web framework (aiohttp), as OpenAI servers are."""
    from aiohttp import web

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 100000}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_waiting 0\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else list(prompt.encode())
        n = int(body.get("max_tokens") or 16)
        fail = isinstance(prompt, str) and prompt.startswith("FAIL")
        if prefill_us:
            await asyncio.sleep(len(ids) * prefill_us / 1e6)
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "text_completion", "model": "m",
                                      "choices": [{"index": 0, "text": "a" * n,
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": len(ids),
                                                "completion_tokens": n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            if fail and i == fail_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            if token_ms and i:
                await asyncio.sleep(token_ms / 1000)
            await resp.write(token_event(ids, i, n))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_upstream(port: int, token_ms: float, prefill_us: float, fail_after: int) -> None:
    """The trivial worker as an asyncio protocol + httptools, lighter than any framework,
    so that it and the client (which share a core) can outrun the proxy on its core."""
    import httptools
    import uvloop

    models = json.dumps({"data": [{"id": "m", "max_model_len": 100000}]}).encode()
    metrics = b"vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_waiting 0\n"

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            url, body = self.url, b"".join(self.body)
            self.url, self.body = b"", []
            if url == b"/v1/models":
                self.send(b"application/json", models)
            elif url == b"/metrics":
                self.send(b"text/plain", metrics)
            elif url == b"/v1/completions":
                self.complete(json.loads(body))
            else:
                self.send(b"text/plain", b"not found", 404)

        def write(self, data: bytes) -> None:
            self.transport.write(data)  # type: ignore[attr-defined]

        def send(self, content_type: bytes, body: bytes, status: int = 200) -> None:
            self.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                       % (status, content_type, len(body), body))

        def complete(self, body: dict[str, Any]) -> None:
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) else list(prompt.encode())
            n = int(body.get("max_tokens") or 16)
            fail = isinstance(prompt, str) and prompt.startswith("FAIL")
            if prefill_us or token_ms or fail:
                self.task = asyncio.ensure_future(self.generate(body, ids, n, fail=fail))
            elif body.get("stream"):  # nothing to wait for: no task, one write per token
                self.write(_SSE_HEAD)
                for event in self.events(ids, n):
                    self.write(event)
                self.write(_SSE_END)
            else:
                self.answer(ids, n)

        def answer(self, ids: list[int], n: int) -> None:
            self.send(b"application/json", json.dumps(
                {"id": "x", "object": "text_completion", "model": "m",
                 "choices": [{"index": 0, "text": "a" * n, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": len(ids), "completion_tokens": n}}).encode())

        @staticmethod
        def events(ids: list[int], n: int) -> Iterator[bytes]:
            """The chunked SSE event of each token."""
            for i in range(n):
                event = token_event(ids, i, n)
                yield b"%x\r\n%s\r\n" % (len(event), event)

        async def generate(self, body: dict[str, Any], ids: list[int], n: int, *,
                           fail: bool) -> None:
            if prefill_us:
                await asyncio.sleep(len(ids) * prefill_us / 1e6)
            if not body.get("stream"):
                self.answer(ids, n)
                return
            self.write(_SSE_HEAD)
            for i, event in enumerate(self.events(ids, n)):
                if fail and i == fail_after:
                    self.transport.close()
                    return
                if token_ms and i:
                    await asyncio.sleep(token_ms / 1000)
                if self.transport.is_closing():
                    return
                self.write(event)
            self.write(_SSE_END)

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


def run_hop(port: int, upstream: str, client: str) -> None:
    """A minimal starlette forwarder, to compare upstream clients on equal terms."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {}

    async def startup() -> None:
        if client == "http1":
            from dynamo_ftctl.http1 import Pool
            state["c"] = Pool()
        elif client == "httpx":
            import httpx
            state["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        else:
            import aiohttp
            state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def forward(request: Request) -> Response:
        data = await request.body()
        headers = {"Content-Type": "application/json"}
        if client == "http1":
            up = await state["c"].request("POST", f"{upstream}/v1/completions", data, headers)
            if b'"stream": true' not in data:
                async with up:
                    return Response(await up.read(), media_type="application/json")

            async def relay() -> AsyncIterator[bytes]:
                async with up:
                    while piece := await up.next_chunk():
                        yield piece

            return StreamingResponse(relay(), media_type="text/event-stream")
        if client == "aiohttp" and b'"stream": true' in data:
            # Streamed: pipe the upstream's bytes through (the floor of a Python SSE hop).
            resp = await state["c"].post(f"{upstream}/v1/completions", data=data,
                                         headers=headers)

            async def pipe() -> AsyncIterator[bytes]:
                try:
                    async for piece in resp.content.iter_any():
                        yield piece
                finally:
                    resp.release()

            return StreamingResponse(pipe(), media_type="text/event-stream")
        if client == "httpx":
            r = await state["c"].post(f"{upstream}/v1/completions", content=data,
                                      headers=headers)
            return Response(r.content, media_type="application/json")
        async with state["c"].post(f"{upstream}/v1/completions", data=data,
                                   headers=headers) as r:
            return Response(await r.read(), media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await startup()
        yield

    app = Starlette(routes=[Route("/v1/completions", forward, methods=["POST"])],
                    lifespan=lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


# ---------------------------------------------------------------- processes

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, deadline_s: float = 20.0) -> None:
    import httpx

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            httpx.get(url, timeout=0.5)
        except httpx.HTTPError:
            time.sleep(0.05)
        else:
            return
    msg = f"{url} did not come up in {deadline_s} s"
    raise SystemExit(msg)


def start(args: list[str], cpus: set[int], probe: str,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    try:
        # Against the CPUs this run was given, not the caller's (`pinned` may narrow those).
        os.sched_setaffinity(proc.pid, cpus & set(CPUS) or set(CPUS))
        wait_http(probe)
    except BaseException:
        proc.kill()
        raise
    return proc


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def upstream(token_ms: float = 0.0, prefill_us: float = 0.0, fail_after: int = 10**9, *,
             kind: str = "lean") -> tuple[subprocess.Popen[bytes], str]:
    """A trivial worker on the other core(s): `lean` (protocol) or `framework` (aiohttp)."""
    port = free_port()
    mode = "upstream" if kind == "lean" else "framework-upstream"
    proc = start([PY, __file__, mode, str(port), str(token_ms), str(prefill_us),
                  str(fail_after)], OTHER_CPUS, f"http://127.0.0.1:{port}/v1/models")
    return proc, f"http://127.0.0.1:{port}"


def proxy(urls: list[str], directory: Path, model: str = "m",
          src: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`ftctl proxy` on CPU 0; from the source tree `src` (its `src/` first on the path)."""
    port = free_port()
    inv = directory / f"inv-{port}.yaml"
    workers = "".join(f"  - {{name: w{i}, url: '{u}', model: {model}}}\n"
                      for i, u in enumerate(urls))
    inv.write_text(f"cluster: bench\nworkers:\n{workers}proxy:\n  listen: 127.0.0.1:{port}\n"
                   "  busy: {active_prefill_tokens_threshold: 100000000}\n")
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src / "src")}
    proc = start([PY, "-m", "dynamo_ftctl", "-i", str(inv), "proxy"], {0},
                 f"http://127.0.0.1:{port}/health", env=env)
    return proc, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def pinned(cpus: set[int]) -> Iterator[None]:
    """Run the block on `cpus` (what it starts inherits them, every thread included)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


CPUS = sorted(os.sched_getaffinity(0))
OTHER_CPUS = set(CPUS[1:]) or set(CPUS)


# ---------------------------------------------------------------- clients

def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run a client coroutine on uvloop (the client must stay lighter than what it measures)."""
    import uvloop

    return uvloop.run(coro)


_JSON = {"Content-Type": "application/json"}


class Record(NamedTuple):
    """What the client saw of one streamed request (seconds)."""

    ttft: float
    e2e: float
    tokens: int
    stamps: list[float]  # each token's arrival, from the request's start
    upstream: float  # the worker's TTFT per the proxy's Server-Timing (nan: direct)

    @property
    def proxy_share(self) -> float:
        """The part of this request's TTFT spent outside the worker: the proxy's work,
        its two hops and its queue (an upper bound on what the proxy adds)."""
        return self.ttft - self.upstream


def _upstream_s(server_timing: str | None) -> float:
    """The `upstream` metric of a Server-Timing header, in seconds (nan without one)."""
    for metric in (server_timing or "").split(","):
        name, *params = metric.strip().split(";")
        if name == "upstream":
            for param in params:
                if param.startswith("dur="):
                    return float(param[4:]) / 1e3
    return float("nan")


async def streams(url: str, body: dict[str, Any], concurrency: int, count: int, *,
                  stagger_s: float = 0.0) -> list[Record]:
    """One `Record` per request; `count` requests, `concurrency` at a time.

    The k-th of the `concurrency` loops starts `k * stagger_s` late (0: all at once, so
    equal streams arrive in bursts of `concurrency`).
    """
    from dynamo_ftctl.http1 import Pool

    out: list[Record] = []
    queue = iter(range(count))
    pool = Pool(user_agent="bench")
    data = json.dumps(body).encode()

    async def one(k: int) -> None:
        await asyncio.sleep(k * stagger_s)
        for _ in queue:
            t0 = time.perf_counter()
            stamps: list[float] = []
            async with await pool.request("POST", f"{url}/v1/completions", data, _JSON) as resp:
                # Count events per read, not per line: the client must stay cheaper
                # than the proxy it measures (they do not share a core, but upstream
                # and client do).
                while piece := await resp.next_chunk(30.0):
                    stamp = time.perf_counter() - t0
                    stamps.extend([stamp] * piece.count(b"data: {"))
                upstream = _upstream_s(resp.header("server-timing"))
            out.append(Record(stamps[0] if stamps else float("nan"),
                              time.perf_counter() - t0, len(stamps), stamps, upstream))

    try:
        await asyncio.gather(*(one(k) for k in range(concurrency)))
    finally:
        pool.close()
    return out


async def rate(url: str, body: dict[str, Any], concurrency: int, seconds: float) -> float:
    """Requests per second of `body` at `concurrency` for `seconds` (bounded loop)."""
    from dynamo_ftctl.http1 import Pool

    done = 0
    end = time.perf_counter() + seconds
    pool = Pool(user_agent="bench")
    data = json.dumps(body).encode()

    async def one() -> None:
        nonlocal done
        while time.perf_counter() < end:
            async with await pool.request("POST", f"{url}/v1/completions", data,
                                          _JSON) as resp:
                await resp.read(timeout_s=30.0)
                if resp.status == 200:
                    done += 1

    start_t = time.perf_counter()
    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))
    finally:
        pool.close()
    return done / (time.perf_counter() - start_t)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def p50(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------- figures

def figure_clients(seconds: float) -> None:
    up, up_url = upstream()
    try:
        results = {}
        for client in ("httpx", "aiohttp", "http1"):
            port = free_port()
            hop = start([PY, __file__, "hop", str(port), up_url, client], {0},
                        f"http://127.0.0.1:{port}/docs-none")
            try:
                url = f"http://127.0.0.1:{port}"
                arun(rate(url, {"prompt": "hi", "max_tokens": 4}, 32, 0.5))
                results[client] = arun(rate(url, {"prompt": "hi", "max_tokens": 4},
                                                   32, seconds))
            finally:
                stop(hop)
        print(f"upstream client, forwarding hop on one core, 32 connections: "
              f"httpx {results['httpx']:,.0f} req/s, aiohttp {results['aiohttp']:,.0f} req/s, "
              f"ftctl http1 {results['http1']:,.0f} req/s (aiohttp/httpx = "
              f"{results['aiohttp'] / results['httpx']:.1f}x, http1/aiohttp = "
              f"{results['http1'] / results['aiohttp']:.2f}x)")
    finally:
        stop(up)


def figure_overhead(directory: Path, count: int, baseline: Path | None) -> None:
    # 20 ms a token (50 tokens/s a stream, a large model's decode pace) and 20 us a prompt
    # token of prefill: 32 streams then carry 1,600 tokens/s, a load the proxy core
    # serves without queueing, so the figure is the proxy's latency, not its saturation.
    body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 32, "stream": True,
            "temperature": 0}
    print(f"overhead, 32 concurrent streams x {count} requests, 120-token prompt, "
          "32 tokens at 20 ms/token, p50:")
    for kind in ("framework", "lean"):
        up, up_url = upstream(token_ms=20.0, prefill_us=20.0, kind=kind)
        procs = [up]
        try:
            targets = {"proxy": proxy([up_url], directory)}
            if baseline is not None:
                targets["baseline proxy"] = proxy([up_url], directory, src=baseline)
            if kind == "framework":
                port = free_port()
                procs.append(start([PY, __file__, "hop", str(port), up_url, "aiohttp"], {0},
                                   f"http://127.0.0.1:{port}/none"))
                targets["bare starlette+aiohttp SSE pipe"] = (procs[-1], f"http://127.0.0.1:{port}")
            procs += [p for p, _ in targets.values()]
            for url in (up_url, *(u for _, u in targets.values())):
                arun(streams(url, body, 32, 32))
            worker = ("an aiohttp worker (a framework, as OpenAI servers are)"
                      if kind == "framework" else "a bare asyncio-protocol worker")
            # Equal streams started together arrive in bursts of 32 (a worst case: the
            # 32nd waits for the proxy to start 31 others); spread over one stream's
            # duration (~0.66 s), the same 32 concurrent streams arrive one by one.
            for arrival, stagger in (("in bursts of 32", 0.0), ("spread out", 0.66 / 32)):
                direct = arun(streams(up_url, body, 32, count, stagger_s=stagger))
                d_ttft, d_e2e = p50([r.ttft for r in direct]), p50([r.e2e for r in direct])
                print(f"  {worker}, arrivals {arrival}: TTFT direct {d_ttft * 1e3:.2f} ms, "
                      f"end-to-end {d_e2e * 1e3:.1f} ms")
                for label, (_, url) in targets.items():
                    via = arun(streams(url, body, 32, count, stagger_s=stagger))
                    v_ttft, v_e2e = p50([r.ttft for r in via]), p50([r.e2e for r in via])
                    print(f"    via {label}: TTFT {v_ttft * 1e3:.2f} ms (ratio "
                          f"{v_ttft / d_ttft:.2f}, {(v_ttft - d_ttft) * 1e3:+.2f} ms); "
                          f"end-to-end {v_e2e * 1e3:.1f} ms (ratio {v_e2e / d_e2e:.2f})"
                          f"{share_note(via, d_ttft)}")
            # Where the added TTFT goes: the proxy's own latency (one stream at a time)
            # vs queueing of simultaneous arrivals on its one core (32 start together).
            short = {**body, "max_tokens": 4}
            for label, (_, url) in targets.items():
                if "pipe" in label:
                    continue
                added = []
                for concurrency in (1, 8):
                    n = max(64, 4 * concurrency)
                    direct = arun(streams(up_url, short, concurrency, n))
                    via = arun(streams(url, short, concurrency, n))
                    d_ttft, v_ttft = p50([r.ttft for r in direct]), p50([r.ttft for r in via])
                    added.append(f"{concurrency} at a time {(v_ttft - d_ttft) * 1e3:+.2f} ms "
                                 f"(ratio {v_ttft / d_ttft:.2f})")
                print(f"    TTFT added by the {label} with fewer streams: {'; '.join(added)}")
        finally:
            stop(*procs)


def figure_overhead_sim(directory: Path, count: int, baseline: Path | None,
                        rounds: int = 5, *, client_beside_proxy: bool = False,
                        stagger_s: float = 0.0) -> None:
    """The same comparison against a real `ftctl sim` worker (prefill and decode are real).

    The proxy runs alone on CPU 0, as a front door has its own cores; the engine, every
    thread of it, on the other core(s), with the client beside it, in the direct
    rounds too (it slows the engine the same in both). With `client_beside_proxy` the
    client shares CPU 0 with the proxy instead (sessions before this one measured so):
    then each token the proxy writes wakes the client on the proxy's own core, which
    preempts it (py-spy: 61% of the proxy's samples in its socket write, 15% with the
    client on the other core), so the client's own work lands in the proxy's figures.
    Direct and proxied rounds alternate for `rounds` rounds (the host's speed drifts
    between runs).

    The k-th of the 32 client loops starts `k * stagger_s` late. Started all at once,
    32 equal streams run in lockstep: straight to the engine they arrive within a
    millisecond and share one prefill, while the proxy's ~0.4 ms per request start
    spreads them over ~13 ms, and the engine falls into another schedule, prefill
    mixed with decode: its own TTFT (per Server-Timing) went from ~50 to ~130 ms in
    some rounds and not in others (round ratios 1.0 or 2.7, as the engine flipped),
    while the proxy's share stayed 1-2 ms. Spread over one stream's length, both arms
    run in the steady state that traffic not synchronised to the millisecond finds:
    rounds then agree within ~7%. Two figures:

    - p50 TTFT through the proxy vs straight to the engine: pooled, and the median of
      the rounds' ratios. At 32 streams the engine's own TTFT moves by up to 30% from
      round to round (which requests share a prefill batch): this cannot resolve 2 ms.
    - the proxy's share, request by request: the client's TTFT less the engine's TTFT as
      the proxy saw it (its Server-Timing header: request written to the first byte of
      the answer). That is the proxy's work, its two extra hops and its queue, free of
      the engine's noise. It bounds what the proxy adds from above: requests that the
      proxy spaces out wait less in the worker's queue, and that wait moves into the
      share (against a saturated worker the share exceeds the same-run difference).
    """
    from dynamo_ftctl.engine.launcher import start_worker

    with pinned(OTHER_CPUS):  # every thread of the engine (torch's too) inherits it
        worker = start_worker("bench-sim", timeout_s=120)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with pinned({CPUS[0]} if client_beside_proxy else OTHER_CPUS):  # the client
            targets = {"proxy": proxy([worker.url], directory, model="ftctl-sim-tiny")}
            if baseline is not None:
                targets["baseline proxy"] = proxy([worker.url], directory, model="ftctl-sim-tiny",
                                                  src=baseline)
            procs += [p for p, _ in targets.values()]
            body = {"model": "ftctl-sim-tiny", "prompt": "hello " * 40, "max_tokens": 32,
                    "stream": True, "temperature": 0}
            for url in (worker.url, *(u for _, u in targets.values())):
                arun(streams(url, body, 32, 32))
            per_round = max(32, count // rounds)
            direct: list[Record] = []
            via: dict[str, list[Record]] = {k: [] for k in targets}
            ratios: dict[str, list[float]] = {k: [] for k in targets}
            for _ in range(rounds):
                d = arun(streams(worker.url, body, 32, per_round, stagger_s=stagger_s))
                direct += d
                for label, (_, url) in targets.items():
                    v = arun(streams(url, body, 32, per_round, stagger_s=stagger_s))
                    via[label] += v
                    ratios[label].append(p50([r.ttft for r in v]) / p50([r.ttft for r in d]))
            d_ttft, d_e2e = p50([r.ttft for r in direct]), p50([r.e2e for r in direct])
            where = "the proxy" if client_beside_proxy else "the engine"
            print(f"overhead vs a real ftctl sim worker (the client beside {where}), 32 "
                  f"concurrent streams, {rounds} rounds x "
                  f"{per_round} requests each way, 240-token prompt, 32 tokens, p50: TTFT direct "
                  f"{d_ttft * 1e3:.1f} ms, end-to-end {d_e2e * 1e3:.0f} ms")
            for label in targets:
                v_ttft = p50([r.ttft for r in via[label]])
                v_e2e = p50([r.e2e for r in via[label]])
                print(f"    via {label}: TTFT {v_ttft * 1e3:.1f} ms pooled (ratio "
                      f"{v_ttft / d_ttft:.2f}, {(v_ttft - d_ttft) * 1e3:+.2f} ms); median of "
                      f"rounds ratio {p50(ratios[label]):.2f} (rounds: "
                      f"{', '.join(f'{x:.2f}' for x in ratios[label])}); end-to-end "
                      f"{v_e2e * 1e3:.0f} ms (ratio {v_e2e / d_e2e:.2f})"
                      f"{share_note(via[label], d_ttft)}")
    finally:
        stop(*procs)
        worker.stop()


def share_note(via: list[Record], direct_ttft: float) -> str:
    """The proxy's share of each request's TTFT (from its Server-Timing), in words."""
    shares = sorted(r.proxy_share for r in via if not math.isnan(r.upstream))
    if not shares:
        return ""
    p90 = shares[int(0.9 * (len(shares) - 1))]
    share = p50(shares)
    return (f"\n      the proxy's share of each TTFT (client TTFT - the worker's per "
            f"Server-Timing; an upper bound): p50 {share * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms; "
            f"direct p50 + p50 share = ratio {(direct_ttft + share) / direct_ttft:.3f}")


def figure_throughput(directory: Path, seconds: float, baseline: Path | None) -> None:
    up, up_url = upstream()
    port = free_port()
    hop = start([PY, __file__, "hop", str(port), up_url, "aiohttp"], {0},
                f"http://127.0.0.1:{port}/none")
    procs = [up, hop]
    try:
        targets = {"proxy": proxy([up_url], directory)}
        if baseline is not None:
            targets["baseline proxy"] = proxy([up_url], directory, src=baseline)
        procs += [p for p, _ in targets.values()]
        plain = {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0}
        hop_url = f"http://127.0.0.1:{port}"
        arun(rate(hop_url, plain, 32, 0.5))
        hop_rps = arun(rate(hop_url, plain, 32, seconds))
        print(f"throughput, pinned to one core, trivial upstream, 32 connections (a bare "
              f"starlette+aiohttp forwarding hop on the same core: {hop_rps:,.0f} "
              "non-streamed req/s):")
        for label, (px, px_url) in targets.items():
            arun(rate(px_url, plain, 32, 0.5))
            cpu0, t0 = cpu_seconds(px.pid), time.perf_counter()
            rps = arun(rate(px_url, plain, 32, seconds))
            busy_rps = (cpu_seconds(px.pid) - cpu0) / (time.perf_counter() - t0)
            body = {"model": "m", "prompt": "hi", "max_tokens": 256, "stream": True,
                    "temperature": 0}
            cpu0, t0 = cpu_seconds(px.pid), time.perf_counter()
            res = arun(streams(px_url, body, 32, max(32, int(seconds * 40))))
            wall = time.perf_counter() - t0
            tokens = sum(r.tokens for r in res) / wall
            busy_tok = (cpu_seconds(px.pid) - cpu0) / wall
            print(f"  {label}: {rps:,.0f} non-streamed requests/s (core {busy_rps:.0%} busy; "
                  f"/hop = {rps / hop_rps:.2f}), {tokens:,.0f} streamed tokens/s (32 streams "
                  f"of 256 tokens; core {busy_tok:.0%} busy); per CPU-second: "
                  f"{rps / busy_rps:,.0f} requests, {tokens / busy_tok:,.0f} tokens")
        print("  (below 100% busy, the upstream and client sharing the other core are the "
              "limit, not the proxy)")
    finally:
        stop(*procs)


def figure_stall(directory: Path, count: int) -> None:
    prefill_us = 20.0  # 20 us per prompt token: a 1,000-token context re-prefills in 20 ms
    token_ms = 2.0
    fail_after = 40
    a, a_url = upstream(token_ms=token_ms, prefill_us=prefill_us, fail_after=fail_after)
    b, b_url = upstream(token_ms=token_ms, prefill_us=prefill_us, fail_after=fail_after)
    px, px_url = proxy([a_url, b_url], directory)
    try:
        prompt = "FAIL" + "x" * 996
        body = {"model": "m", "prompt": prompt, "max_tokens": 80, "stream": True,
                "temperature": 0}
        gaps: list[float] = []
        for _ in range(count):
            (rec,) = arun(streams(px_url, body, 1, 1))
            stamps = rec.stamps
            if len(stamps) != 80:
                msg = f"expected 80 tokens through the proxy, got {len(stamps)}"
                raise SystemExit(msg)
            gaps.append(stamps[fail_after] - stamps[fail_after - 1])
        same = {"model": "m", "prompt": list(b"x" * (1000 + fail_after)), "max_tokens": 1,
                "stream": True, "temperature": 0}
        prefill = [arun(streams(b_url, same, 1, 1))[0].ttft for _ in range(count)]
        extra = p50(gaps) - token_ms / 1e3
        print(f"migration stall, {count} runs, 1,000-token prompt cut after {fail_after} tokens: "
              f"p50 extra gap {extra * 1e3:.1f} ms vs re-prefill of 1,040 tokens on an idle "
              f"worker {p50(prefill) * 1e3:.1f} ms (extra - re-prefill = "
              f"{(extra - p50(prefill)) * 1e3:+.1f} ms; goal <= +20 ms)")
    finally:
        stop(px, a, b)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("upstream", "framework-upstream"):
        serve = run_upstream if sys.argv[1] == "upstream" else run_framework_upstream
        serve(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "hop":
        run_hop(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--only", choices=["clients", "overhead", "sim", "throughput", "stall"])
    parser.add_argument("--client-beside-proxy", action="store_true",
                        help="real-engine figure: run the client on the proxy's core, not "
                             "beside the engine (how sessions before 8 measured it)")
    parser.add_argument("--stagger-ms", type=float, default=16.0, metavar="MS",
                        help="real-engine figure: start the k-th of the 32 client loops k*MS "
                             "late (default 16: spread over one stream's length; 0: all at "
                             "once, in lockstep)")
    parser.add_argument("--baseline-src", type=Path, metavar="DIR",
                        help="also run the overhead and throughput figures, in the same run, "
                             "on a proxy from this source tree (e.g. `git archive` of an "
                             "older commit unpacked in DIR)")
    args = parser.parse_args()
    seconds = 1.5 if args.quick else 4.0
    print(f"benchmarks/proxy.py on {len(CPUS)} CPUs (proxy pinned to CPU 0); "
          "noisy shared machine: run twice, take the median")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if args.only in (None, "clients"):
            figure_clients(seconds)
        if args.only in (None, "overhead"):
            figure_overhead(directory, 96 if args.quick else 256, args.baseline_src)
        if args.only in (None, "sim"):
            # Rounds of 160 requests per arm: in rounds of one burst (32), the engine's
            # batching alone moved the p50 by up to 50% from round to round.
            figure_overhead_sim(directory, 320 if args.quick else 960, args.baseline_src,
                                rounds=4 if args.quick else 6,
                                client_beside_proxy=args.client_beside_proxy,
                                stagger_s=args.stagger_ms / 1e3)
        if args.only in (None, "throughput"):
            figure_throughput(directory, seconds, args.baseline_src)
        if args.only in (None, "stall"):
            figure_stall(directory, 5 if args.quick else 15)


if __name__ == "__main__":
    main()
