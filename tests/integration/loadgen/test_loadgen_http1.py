"""The http1 client against scripted raw-socket servers on loopback: framing, reuse, failures."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from typing import Any

import pytest
from tests.loopback import Handler, Server

from dynamo_ftctl.loadgen.config import Length, Workload
from dynamo_ftctl.loadgen.record import RequestRecord
from dynamo_ftctl.loadgen.sender import Http1Sender
from dynamo_ftctl.loadgen.workload import RequestFactory

pytestmark = pytest.mark.integration



def _body_doc(tokens: int) -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": "x" * tokens,
                                    "finish_reason": "length"}],
                       "usage": {"completion_tokens": tokens}}).encode()


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _sse_body(tokens: int, *, tail: bytes = b"", newline: bytes = b"\n") -> bytes:
    events = [_event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
              for _ in range(tokens - 1)]
    events.append(_event({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}))
    events.append(_event({"choices": [], "usage": {"completion_tokens": tokens}}))
    body = b"".join(events) + tail + b"data: [DONE]\n\n"
    return body.replace(b"\n", newline)


def _chunked(body: bytes, piece: int) -> bytes:
    out = b""
    for i in range(0, len(body), piece):
        part = body[i:i + piece]
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length) if length else b""


def _exchange(handler: Handler, *, requests: int = 1, stream: bool = True,
              timeout_s: float = 5.0) -> tuple[list[RequestRecord], int]:
    """Send `requests` requests one after another; the records and connections opened."""

    async def scenario() -> tuple[list[RequestRecord], int]:
        async with Server(handler) as server:
            factory = RequestFactory(Workload(stream=stream, max_tokens=Length.fixed(4)),
                                     (server.url,), model="m")
            sender = Http1Sender(timeout_s=timeout_s, now=time.monotonic)
            t0 = time.monotonic()
            try:
                records = [await sender.send(factory.build(i), 0.0, warmup=False, t0=t0)
                           for i in range(requests)]
            finally:
                sender.close()
            return records, server.connections

    return asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def _head(status: int, *headers: str) -> bytes:
    return (f"HTTP/1.1 {status} X\r\n" + "".join(h + "\r\n" for h in headers)
            + "\r\n").encode()


def test_content_length_answers_reuse_one_connection() -> None:
    """Three non-streamed answers with a length come back ok over one keep-alive connection."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        while True:
            await _read_request(reader)
            body = _body_doc(4)
            writer.write(_head(200, "content-type: application/json",
                               f"content-length: {len(body)}") + body)

    records, connections = _exchange(handler, requests=3, stream=False)
    assert [r.outcome for r in records] == ["ok"] * 3
    assert all(r.output_tokens == 4 and r.first_token is not None for r in records)
    assert connections == 1


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_chunked_stream_in_any_pieces(piece: int, newline: bytes) -> None:
    """An SSE stream in chunks of any size, LF or CRLF lines, counts every token, and its
    trailing `: x-ftctl-migrated: 2` comment makes the answer `migrated`."""
    body = _sse_body(5, tail=b": x-ftctl-migrated: 2\n\n", newline=newline)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        while True:
            await _read_request(reader)
            writer.write(_head(200, "content-type: text/event-stream",
                               "transfer-encoding: chunked"))
            framed = _chunked(body, piece)
            for i in range(0, len(framed), 512):
                writer.write(framed[i:i + 512])
                await writer.drain()

    records, connections = _exchange(handler, requests=2)
    for rec in records:
        assert (rec.outcome, rec.migrated, rec.output_tokens, len(rec.itl)) == (
            "migrated", 2, 5, 4), rec.error
    assert connections == 1


def test_connection_close_and_body_until_close() -> None:
    """`Connection: close` and a body read until the server hangs up are answers too; each
    request then takes a new connection."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await _read_request(reader)
        body = _body_doc(4)
        if n == 1:
            writer.write(_head(200, "content-type: application/json", "connection: close",
                               f"content-length: {len(body)}") + body)
        else:  # no length, no chunking: the body ends when the connection does
            writer.write(_head(200, "content-type: application/json") + body)
        await writer.drain()

    records, connections = _exchange(handler, requests=2, stream=False)
    assert [r.outcome for r in records] == ["ok", "ok"], [r.error for r in records]
    assert [r.output_tokens for r in records] == [4, 4]
    assert connections == 2


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def test_reset_before_and_during_the_answer() -> None:
    """A reset before any byte of the answer is `connect`; one mid-stream is `broken_stream`."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await _read_request(reader)
        if n == 2:
            writer.write(_head(200, "content-type: text/event-stream",
                               "transfer-encoding: chunked") + _chunked(_sse_body(5)[:150], 50)[:-5])
            await writer.drain()
        _reset(writer)

    records, _ = _exchange(handler, requests=2)
    assert [r.outcome for r in records] == ["connect", "broken_stream"]
    assert records[1].status == 200


def test_timeout_bounds_the_whole_exchange() -> None:
    """A server that reads the request and never answers is a `timeout` after timeout_s."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await _read_request(reader)
        await reader.read()  # until the client gives up

    started = time.monotonic()
    records, _ = _exchange(handler, timeout_s=0.3)
    assert records[0].outcome == "timeout"
    assert 0.25 <= time.monotonic() - started < 5


def test_http_error_classes_keep_retry_after() -> None:
    """429/503 keep Retry-After (seconds or an HTTP date) in the record; a 500's is ignored."""
    soon = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    answers = [(429, "retry-after: 3"), (503, f"retry-after: {soon}"), (500, "retry-after: 3"),
               (404, "x-other: 1")]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        for status, header in answers:
            await _read_request(reader)
            body = b'{"error":{"message":"no"}}'
            writer.write(_head(status, header, "content-type: application/json",
                               f"content-length: {len(body)}") + body)

    records, connections = _exchange(handler, requests=4)
    assert [r.outcome for r in records] == ["4xx_429", "5xx_503", "5xx_500", "4xx_404"]
    assert records[0].retry_after_s == 3.0
    assert records[1].retry_after_s is not None
    assert 20 < records[1].retry_after_s <= 31
    assert records[2].retry_after_s is None
    assert records[3].retry_after_s is None
    assert connections == 1


def test_broken_streams_and_garbage() -> None:
    """An SSE error event, a stream that ends without a finish, a cut length body and a
    reply that is not HTTP each land in their class."""
    error_body = _event({"error": {"message": "worker died"}}) + b"data: [DONE]\n\n"
    unfinished = _event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await _read_request(reader)
        sse = _head(200, "content-type: text/event-stream", "transfer-encoding: chunked",
                    "connection: close")
        if n == 1:
            writer.write(sse + _chunked(error_body, 1000))
        elif n == 2:
            writer.write(sse + _chunked(unfinished, 1000))
        elif n == 3:
            writer.write(_head(200, "content-type: application/json", "content-length: 64")
                         + b'{"choices":[')
        else:
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    records, connections = _exchange(handler, requests=4)
    assert [r.outcome for r in records] == ["broken_stream", "broken_stream",
                                            "broken_stream", "other"]
    assert "worker died" in (records[0].error or "")
    assert records[1].error == "stream ended before a finish reason"
    assert records[2].status == 200
    assert records[3].status is None
    assert connections == 4


def test_refused_connection_is_connect() -> None:
    """Nothing listening: `connect`, without waiting for the timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario() -> RequestRecord:
        factory = RequestFactory(Workload(), (f"http://127.0.0.1:{port}",), model="m")
        sender = Http1Sender(timeout_s=5, now=time.monotonic)
        try:
            return await sender.send(factory.build(0), 0.0, warmup=False, t0=time.monotonic())
        finally:
            sender.close()

    record = asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert record.outcome == "connect"
    assert record.e2e_from_sent_s < 4
