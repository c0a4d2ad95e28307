"""The sim's lean streaming path: templated chunks equal the JSON encoder's; an SSE body on
the server goes out chunk by chunk and is closed when its client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.engine.stream import SERVER_TTFT_FIELD, ChunkWriter, Step
from dynamo_ftctl.httpserver import Request, Stream, start_server
from dynamo_ftctl.openai import format_sse
from tests.waiting import until

# Any text the detokenizer may hand over, lone surrogates (undecodable bytes) included.
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)


@settings(max_examples=300, deadline=None)
@given(rid=texts, text=texts, token_id=st.integers(0, 300), chat=st.booleans(),
       ids=st.booleans(), finish=st.sampled_from([None, "length", "stop"]),
       ttft=st.one_of(st.none(), st.floats(0, 1e5, allow_nan=False).map(lambda x: round(x, 3))))
def test_template_chunk_is_byte_identical_to_the_json_encoder(
        rid: str, text: str, token_id: int, chat: bool, ids: bool, finish: str | None,
        ttft: float | None) -> None:
    """A templated token chunk is exactly what format_sse writes for the same dict."""
    writer = ChunkWriter(rid, "ftctl-sim-tiny", 1700000000, chat=chat, token_ids=ids)
    step = Step(token_id, text, -0.5, (), finish)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    if ids:
        choice["token_ids"] = [token_id]
    top = {} if ttft is None else {SERVER_TTFT_FIELD: ttft}
    expected = format_sse({"id": rid, "object": writer.kind, "created": 1700000000,
                           "model": "ftctl-sim-tiny", "choices": [choice], **top})
    got = writer.token(step, ttft).encode()
    assert got == expected
    assert json.loads(got[6:])["choices"][0]["finish_reason"] == finish


async def _serve_stream(body: AsyncGenerator[bytes, None], *, leave_after: int | None
                        ) -> tuple[bytes, bool]:
    """Serve `body` as the sim serves a stream; read it raw (all of it, or until
    `leave_after` chunks, then hang up); (bytes read, body closed)."""
    closed = asyncio.Event()

    async def tracked() -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            closed.set()

    async def handler(_: Request) -> Stream:
        return Stream(tracked(), headers={"X-Request-Id": "r1", "Cache-Control": "no-cache"})

    server = await start_server(handler, "127.0.0.1", 0)
    try:
        port = int(server.address.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        got = b""
        while leave_after is None or got.count(b"data: ") < leave_after:
            piece = await reader.read(65536)
            got += piece
            if not piece or got.endswith(b"0\r\n\r\n"):
                break
        writer.close()
        await until(closed.is_set)
        return got, closed.is_set()
    finally:
        await server.shutdown(1.0)


async def _endless() -> AsyncGenerator[bytes, None]:
    while True:
        yield b"data: {}\n\n"
        await asyncio.sleep(0.001)


async def _three() -> AsyncGenerator[bytes, None]:
    for i in range(3):
        yield b"data: %d\n\n" % i


def test_stream_sends_headers_chunks_and_end() -> None:
    """Headers (SSE type, request id), every chunk in order, then the end of the body."""
    got, closed = asyncio.run(asyncio.wait_for(_serve_stream(_three(), leave_after=None), 10))
    head, _, chunked = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-type: text/event-stream; charset=utf-8\r\n" in head
    assert b"X-Request-Id: r1\r\n" in head
    assert head.endswith(b"\r\ntransfer-encoding: chunked")
    assert chunked == b"".join(b"%x\r\n%s\r\n" % (len(c), c)
                               for c in (b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n")) \
        + b"0\r\n\r\n"
    assert closed


def test_a_client_that_leaves_closes_the_body_without_an_error() -> None:
    """A hang-up mid-stream stops an endless body at once (its `finally` runs)."""
    got, closed = asyncio.run(asyncio.wait_for(_serve_stream(_endless(), leave_after=5), 10))
    assert closed
    assert got.count(b"data: ") >= 5
