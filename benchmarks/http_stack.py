"""Which HTTP server should every ftctl service run on? httpserver vs uvicorn + starlette.

One run, same trivial OpenAI-like endpoint on both stacks (`POST /v1/completions`:
a non-streamed 16-token answer, or with `"stream": true` a 64-token SSE answer;
the body is parsed as JSON on both): (a) `dynamo_ftctl.httpserver` +
`httpapp.Router` on uvloop, as the proxy and the sim serve; (b) uvicorn +
starlette (`StreamingResponse`), uvloop and httptools, as the sim served before
issue 24. The server runs pinned to CPU 0, the client (`wrk` when on PATH, else
the load generator's http1 client) to CPU 1, 32 keep-alive connections.
Figure: requests answered per CPU-second of the server process (its utime +
stime from /proc), non-streamed and streamed.

Then each server's default limits against hostile input, on fresh processes:
a 100 KB header, 100,000 headers (the status it answers, or how the
connection ended), and 50 slowloris connections (a header line a second, never
the end of the head): how long the server holds them (bounded by
`--slowloris-s`; both servers are attacked at once).

Run: .venv/bin/python benchmarks/http_stack.py [--seconds 3] [--slowloris-s 35]
Exits 1 when httpserver does not win on both throughputs or is weaker on any attack.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STACKS = ("httpserver", "uvicorn")
CONNECTIONS = 32  # as http_clients.py, whose clients this script runs
BODY = b'{"model":"m","prompt":"hello","max_tokens":16}'
STREAM_BODY = b'{"model":"m","prompt":"hello","max_tokens":64,"stream":true}'
SLOWLORIS = 50
_TOKEN = " tok"


def _answer() -> bytes:
    return json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": _TOKEN * 16, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17},
    }, separators=(",", ":")).encode()


def _chunks() -> list[bytes]:
    """The 64 SSE token events of a streamed answer, then [DONE]."""
    events = [b"data: " + json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": _TOKEN,
                     "finish_reason": "length" if i == 63 else None}],
    }, separators=(",", ":")).encode() + b"\n\n" for i in range(64)]
    return [*events, b"data: [DONE]\n\n"]


# -- the servers (child processes: `http_stack.py --serve STACK`)

def _serve_httpserver() -> None:
    import asyncio

    from dynamo_ftctl.httpapp import Router, json_reply, loop_factory
    from dynamo_ftctl.httpserver import Reply, Request, Stream, start_server

    answer, chunks = _answer(), _chunks()

    async def pieces() -> Any:
        for chunk in chunks:
            yield chunk

    async def completions(request: Request) -> Reply | Stream:
        if json.loads(request.body).get("stream"):
            return Stream(pieces())
        return Reply(200, answer)

    async def health(_: Request) -> Reply:
        return json_reply({"status": "ok"})

    router = Router()
    router.post("/v1/completions", completions)
    router.get("/health", health)

    async def main() -> None:
        server = await start_server(router, "127.0.0.1", 0)
        print(server.address, flush=True)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())


def _serve_uvicorn() -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    answer, chunks = _answer(), _chunks()

    async def pieces() -> Any:
        for chunk in chunks:
            yield chunk

    async def completions(request: Request) -> Response:
        if json.loads(await request.body()).get("stream"):
            return StreamingResponse(pieces(), media_type="text/event-stream")
        return Response(answer, media_type="application/json")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/health", health, methods=["GET"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    # As `ftctl sim` configured it before issue 24.
    config = uvicorn.Config(app, log_level="error", access_log=False, loop="auto", http="auto",
                            ws="none", timeout_keep_alive=30, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() else []


@contextmanager
def server(stack: str) -> Iterator[tuple[str, int]]:
    """Start one stack's server on CPU 0; yield (base URL, pid)."""
    proc = subprocess.Popen([*_pin(0), sys.executable, __file__, "--serve", stack],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("http://"):
            msg = f"{stack} server did not start: {line!r}"
            raise RuntimeError(msg)
        url = line.strip()
        _wait_listening(url)
        yield url, proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _wait_listening(url: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection(_address(url), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            msg = f"{url} does not answer /health"
            raise RuntimeError(msg)
        time.sleep(0.05)


def _cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- throughput

def _client_rate(url: str, seconds: float, body: bytes) -> float:
    """Requests/s of `http_clients.py`'s closed loop on CPU 1: wrk, else ftctl's http1."""
    from http_clients import bench_http1, bench_wrk  # this folder, on sys.path as a script's

    if shutil.which("wrk"):
        return bench_wrk(url, seconds, body)
    import asyncio

    mask = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    try:
        return asyncio.run(bench_http1(url, seconds, body))
    finally:
        os.sched_setaffinity(0, mask)


def throughput(stack: str, seconds: float, *, stream: bool) -> float:
    """Requests answered per CPU-second of the server."""
    body = STREAM_BODY if stream else BODY
    with server(stack) as (url, pid):
        _client_rate(url, 1, body)  # warm the connections and caches
        before = _cpu_s(pid)
        rate = _client_rate(url, seconds, body)
        cpu = _cpu_s(pid) - before
    # wrk and the closed loop run `seconds` (wrk: rounded to whole seconds).
    return rate * max(1, round(seconds)) / cpu if cpu > 0 else float("nan")


# -- hostile input

def _status_after(sock: socket.socket, payload: bytes, timeout_s: float = 10.0) -> str:
    """Send `payload` (the server may stop reading it), then what came back: the status
    code, or how the connection ended."""
    sock.settimeout(timeout_s)
    with contextlib.suppress(OSError):  # refused mid-send: its answer may still be readable
        sock.sendall(payload)
    try:
        head = sock.recv(64)
    except TimeoutError:
        return "no answer"
    except ConnectionResetError:
        return "reset"
    if not head:
        return "closed"
    return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "garbage"


def big_header(url: str) -> str:
    with socket.create_connection(_address(url), timeout=10) as sock:
        return _status_after(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
                             + b"a" * 100_000 + b"\r\n\r\n")


def many_headers(url: str) -> str:
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(100_000))
    with socket.create_connection(_address(url), timeout=10) as sock:
        return _status_after(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")


def slowloris(urls: dict[str, str], bound_s: float) -> dict[str, tuple[float, str]]:
    """Open `SLOWLORIS` connections to each server, each sending a header line a second
    and never the blank line; per server: (seconds until the last one was closed, or
    `bound_s` when some still hold; what the server answered, by count)."""
    socks: dict[socket.socket, str] = {}
    for stack, url in urls.items():
        for _ in range(SLOWLORIS):
            sock = socket.create_connection(_address(url), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            sock.setblocking(False)
            socks[sock] = stack
    start = time.monotonic()
    ended: dict[str, list[float]] = {stack: [] for stack in urls}
    answers: dict[str, list[str]] = {stack: [] for stack in urls}
    next_line = start + 1.0
    while socks and time.monotonic() - start < bound_s:
        readable, _, _ = select.select(list(socks), [], [], 0.1)
        for sock in readable:
            stack = socks.pop(sock)
            try:
                data = sock.recv(64)
            except OSError:
                data = b""
            answers[stack].append(data.split(b" ", 2)[1].decode()
                                  if data.startswith(b"HTTP/") else "closed")
            ended[stack].append(time.monotonic() - start)
            sock.close()
        if time.monotonic() >= next_line:
            next_line += 1.0
            for sock in list(socks):
                with contextlib.suppress(OSError):  # closed: select reports it
                    sock.send(b"X-Slow: 1\r\n")
    result = {}
    for stack in urls:
        held = bound_s if any(s == stack for s in socks.values()) else max(ended[stack],
                                                                           default=0.0)
        counts = {a: answers[stack].count(a) for a in sorted(set(answers[stack]))}
        still = sum(1 for s in socks.values() if s == stack)
        what = ", ".join(f"{n} x {a}" for a, n in counts.items())
        result[stack] = (held, what + (f"{', ' if what else ''}{still} still open" if still
                                       else ""))
    for sock in socks:
        sock.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--slowloris-s", type=float, default=35.0,
                        help="How long the slowloris clients hold on at the most.")
    parser.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        (_serve_httpserver if args.serve == "httpserver" else _serve_uvicorn)()
        return 0
    client = "wrk" if shutil.which("wrk") else "ftctl http1"
    print(f"server on CPU 0, client ({client}) on CPU 1, {CONNECTIONS} connections, "
          f"{args.seconds:g} s a figure")
    rates: dict[str, dict[str, float]] = {}
    for stream in (False, True):  # interleaved: the machine's noise hits both stacks alike
        for stack in STACKS:
            rates.setdefault(stack, {})["stream" if stream else "plain"] = throughput(
                stack, args.seconds, stream=stream)
    hostile: dict[str, dict[str, str]] = {stack: {} for stack in STACKS}
    with server("httpserver") as (a, _), server("uvicorn") as (b, _):
        urls = {"httpserver": a, "uvicorn": b}
        for stack, url in urls.items():
            hostile[stack]["big"] = big_header(url)
            hostile[stack]["many"] = many_headers(url)
        for stack, (held, what) in slowloris(urls, args.slowloris_s).items():
            bound = "≥ " if held >= args.slowloris_s else ""
            hostile[stack]["slow"] = f"held {bound}{held:.1f} s ({what})"
    rows = [
        ("non-streamed requests / server CPU-s (16 tokens)",
         {s: f"{rates[s]['plain']:,.0f}" for s in STACKS}),
        ("streamed requests / server CPU-s (64 SSE tokens)",
         {s: f"{rates[s]['stream']:,.0f}" for s in STACKS}),
        ("100 KB header", {s: hostile[s]["big"] for s in STACKS}),
        ("100,000 headers", {s: hostile[s]["many"] for s in STACKS}),
        (f"{SLOWLORIS} slowloris connections", {s: hostile[s]["slow"] for s in STACKS}),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"| {'':{width}} | httpserver + httpapp.Router | uvicorn + starlette |")
    print(f"|{'-' * (width + 2)}|---|---|")
    for name, cells in rows:
        print(f"| {name:{width}} | {cells['httpserver']} | {cells['uvicorn']} |")
    faster = all(rates["httpserver"][k] > rates["uvicorn"][k] for k in ("plain", "stream"))
    refused = all(hostile["httpserver"][k] in ("431", "400") for k in ("big", "many"))
    timely = "still open" not in hostile["httpserver"]["slow"]
    if not (faster and refused and timely):
        print("httpserver does not win on every row: see the table", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
