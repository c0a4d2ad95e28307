"""A controllable loopback target for the load generator: a tiny OpenAI-style server.

It answers `POST /v1/completions` and `/v1/chat/completions` (streaming or
not) with `max_tokens` one-byte tokens, and can be told to misbehave: a fixed
latency before the first byte, a delay between tokens, a stall of every
request for a while after the N-th one, a limited number of requests served
at once (a known capacity), and a cycling script of outcomes (HTTP status
codes, shed ones (429, 503, 529) with `Retry-After: 2`, a stream broken
half-way, a hang, a migrated answer carrying `x-ftctl-migrated`, or one that
says so only in a trailing SSE comment as `ftctl proxy` does after a
mid-stream migration: `migrated-late`). It is the server of the load
generator's own tests and benchmarks, written on raw asyncio streams with
token frames encoded once, so that it outruns the client on one core; it is
not an inference engine (that is `ftctl sim`).

It stays off the package's HTTP server (`httpserver`, which every ftctl service
uses) on purpose: its job is to misbehave in ways that server refuses to (a
Content-Length it never fills, a chunked body cut before its last chunk, a hang
with no timeout), and on that server a non-streamed answer costs the target more
CPU (docs/benchmarks.md, load.py), which would lower the generator's ceiling.

Run it with `python -m dynamo_ftctl.loadgen.target --port 0`; it prints
`listening on 127.0.0.1:PORT` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from dynamo_ftctl.httpserver import listen_streams
from dynamo_ftctl.jsoncodec import loads

__all__ = ["TargetConfig", "main", "serve"]

# Outcomes a script may name; a number is an HTTP status.
_ACTIONS = frozenset({"ok", "break", "hang", "migrated", "migrated-late"})


@dataclass(frozen=True)
class TargetConfig:
    """How the target behaves; every delay is in seconds."""

    host: str = "127.0.0.1"
    port: int = 0
    latency_s: float = 0.0
    itl_s: float = 0.0
    stall_after: int | None = None
    stall_s: float = 0.0
    capacity: int | None = None
    service_s: float = 0.0
    script: tuple[str, ...] = ("ok",)
    default_max_tokens: int = 16

    def __post_init__(self) -> None:
        for action in self.script:
            if action not in _ACTIONS and not (action.isdigit() and 100 <= int(action) <= 599):
                msg = (f"unknown script action {action!r} "
                       "(ok, break, hang, migrated, migrated-late or a status)")
                raise ValueError(msg)


@dataclass
class _State:
    config: TargetConfig
    served: int = 0
    stall_until: float = 0.0
    script: Iterator[str] = field(default_factory=lambda: iter(()))
    gate: asyncio.Semaphore | None = None
    # Server-side TTFT of each answered request (request read → first token written).
    ttft_s: list[float] = field(default_factory=list)


_REASONS = {200: "OK", 404: "Not Found", 400: "Bad Request"}


def _head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_response(status: int, doc: object, extra: Sequence[tuple[str, str]] = ()) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(body))),
               *extra]
    return _head(status, headers) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@functools.lru_cache(maxsize=16384)
def _token_chunk(chat: bool, index: int) -> bytes:
    """The chunked-encoding frame of token `index`'s SSE event, encoded once."""
    return _chunk(_token_event(chat, index))


def _token_event(chat: bool, index: int) -> bytes:
    if chat:
        doc: dict[str, object] = {"object": "chat.completion.chunk",
                                  "choices": [{"index": 0, "delta": {"content": "x"},
                                               "finish_reason": None}]}
    else:
        doc = {"object": "text_completion",
               "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    doc["id"] = f"t{index}"
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    body = await reader.readexactly(length) if length else b""
    return method, path, headers, body


async def _answer(state: _State, path: str, body: bytes, writer: asyncio.StreamWriter,
                  received: float) -> bool:
    """Write one answer; False when the connection must be closed after it."""
    config = state.config
    if path == "/stats":  # what the server measured, for the overhead benchmark
        writer.write(_json_response(200, {"ttft_s": state.ttft_s, "served": state.served}))
        return True
    if path in ("/health", "/v1/models"):
        writer.write(_json_response(200, {"status": "ok"}))
        return True
    if path not in ("/v1/completions", "/v1/chat/completions"):
        writer.write(_json_response(404, {"error": {"message": f"no route {path}"}}))
        return True
    try:
        request = loads(body) if body else {}
    except ValueError:
        writer.write(_json_response(400, {"error": {"message": "body is not JSON"}}))
        return True
    chat = path.endswith("chat/completions")
    stream = bool(request.get("stream"))
    tokens = int(request.get("max_tokens") or config.default_max_tokens)
    action = next(state.script)
    state.served += 1
    loop_now = time.monotonic()
    if config.stall_after is not None and state.served == config.stall_after + 1:
        state.stall_until = loop_now + config.stall_s
    if state.stall_until > loop_now:
        await asyncio.sleep(state.stall_until - loop_now)
    if state.gate is not None:
        async with state.gate:
            await asyncio.sleep(config.service_s)
    if config.latency_s:
        await asyncio.sleep(config.latency_s)
    if action == "hang":
        await asyncio.sleep(3600)
        return False
    if action.isdigit():
        shed = [("retry-after", "2")] if action in ("429", "503", "529") else []
        writer.write(_json_response(int(action), {"error": {"message": f"scripted {action}"}},
                                    shed))
        return True
    extra = [("x-ftctl-migrated", "1")] if action == "migrated" else []
    if action == "break" and not stream:
        # Promise a body, send half of it, and hang up.
        writer.write(_head(200, [("content-type", "application/json"),
                                 ("content-length", "64")]) + b'{"choices":[')
        return False
    if not stream:
        text = "x" * tokens
        choice: dict[str, object] = (
            {"index": 0, "message": {"role": "assistant", "content": text},
             "finish_reason": "length"}
            if chat else {"index": 0, "text": text, "finish_reason": "length"})
        doc = {"id": "t", "object": "chat.completion" if chat else "text_completion",
               "choices": [choice],
               "usage": {"prompt_tokens": 0, "completion_tokens": tokens,
                         "total_tokens": tokens}}
        writer.write(_json_response(200, doc, extra))
        state.ttft_s.append(time.monotonic() - received)
        return True
    writer.write(_head(200, [("content-type", "text/event-stream"),
                             ("transfer-encoding", "chunked"), *extra]))
    last = tokens // 2 if action == "break" else tokens
    for index in range(last):
        if writer.is_closing():  # the client left (wrk stops mid-stream at its deadline)
            return False
        writer.write(_token_chunk(chat, index))
        if index == 0:
            await writer.drain()
            state.ttft_s.append(time.monotonic() - received)
        if config.itl_s:
            await writer.drain()
            await asyncio.sleep(config.itl_s)
    if action == "break":
        await writer.drain()
        return False
    final: dict[str, object] = {"object": "text_completion",
                                "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                                "usage": {"prompt_tokens": 0, "completion_tokens": tokens,
                                          "total_tokens": tokens}}
    writer.write(_chunk(b"data: " + json.dumps(final).encode() + b"\n\n"))
    if action == "migrated-late":
        writer.write(_chunk(b": x-ftctl-migrated: 1\n\n"))
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return True


async def _connection(state: _State, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                _method, path, headers, body = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                return
            keep = await _answer(state, path, body, writer, time.monotonic())
            await writer.drain()
            if not keep or headers.get("connection", "").lower() == "close":
                return
    except ConnectionError:
        return
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def serve(config: TargetConfig, ready: asyncio.Future[int] | None = None) -> None:
    """Serve until cancelled; `ready` receives the bound port."""
    state = _State(config=config, script=itertools.cycle(config.script),
                   gate=asyncio.Semaphore(config.capacity) if config.capacity else None)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _connection(state, reader, writer)

    listener = await listen_streams(handle, config.host, config.port, backlog=4096)
    port = int(listener.sockets[0].getsockname()[1])
    if ready is not None:
        ready.set_result(port)
    try:
        await asyncio.Event().wait()  # until cancelled
    finally:
        listener.close()


def _parse(argv: Sequence[str] | None) -> TargetConfig:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ftctl.loadgen.target",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before first byte")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--stall-after", type=int, default=None,
                        help="stall every request for --stall seconds after this many")
    parser.add_argument("--stall", type=float, default=0.0)
    parser.add_argument("--capacity", type=int, default=None,
                        help="requests served at once (each takes --service seconds)")
    parser.add_argument("--service", type=float, default=0.0)
    parser.add_argument("--script", default="ok",
                        help="comma-separated cycle of outcomes: ok, break, hang, migrated, "
                             "migrated-late, 503…")
    args = parser.parse_args(argv)
    return TargetConfig(host=args.host, port=args.port, latency_s=args.latency,
                        itl_s=args.itl, stall_after=args.stall_after, stall_s=args.stall,
                        capacity=args.capacity, service_s=args.service,
                        script=tuple(s.strip() for s in args.script.split(",") if s.strip()))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the target until interrupted; print the bound address once listening."""
    config = _parse(argv)

    async def run() -> None:
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(config, ready))
        port = await ready
        sys.stdout.write(f"listening on {config.host}:{port}\n")
        sys.stdout.flush()
        await task

    # On uvloop when installed: the target must outrun the generator it measures.
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=factory) as runner:
        runner.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
