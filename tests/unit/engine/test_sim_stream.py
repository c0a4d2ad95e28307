"""The sim's lean streaming path: templated chunks equal the JSON encoder's, EventStream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.engine.server import SERVER_TTFT_FIELD, _ChunkWriter, _Step
from dynamo_ftctl.openai import format_sse

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
    writer = _ChunkWriter(rid, "ftctl-sim-tiny", 1700000000, chat=chat, token_ids=ids)
    step = _Step(token_id, text, -0.5, (), finish)
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


def _run_stream(body: AsyncGenerator[bytes, None], *, leave_after: int | None
                ) -> tuple[list[dict[str, Any]], bool]:
    """Drive an EventStream with an in-memory ASGI peer; (messages sent, body closed)."""
    from dynamo_ftctl.engine.stream import EventStream

    sent: list[dict[str, Any]] = []
    closed = False

    async def tracked() -> AsyncGenerator[bytes, None]:
        nonlocal closed
        try:
            async for chunk in body:
                yield chunk
        finally:
            closed = True

    async def main() -> None:
        left = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            bodies = sum(1 for m in sent if m["type"] == "http.response.body")
            if leave_after is not None and bodies >= leave_after:
                left.set()

        response = EventStream(tracked(), headers={"X-Request-Id": "r1"})
        await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=10)

    asyncio.run(main())
    return sent, closed


async def _endless() -> AsyncGenerator[bytes, None]:
    while True:
        yield b"data: {}\n\n"
        await asyncio.sleep(0.001)


async def _three() -> AsyncGenerator[bytes, None]:
    for i in range(3):
        yield b"data: %d\n\n" % i


def test_event_stream_sends_headers_chunks_and_end() -> None:
    """Headers (SSE type, request id), every chunk in order, then the end of the body."""
    sent, closed = _run_stream(_three(), leave_after=None)
    assert sent[0]["type"] == "http.response.start"
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-request-id"] == b"r1"
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False
    assert closed


def test_a_client_that_leaves_closes_the_body_without_an_error() -> None:
    """http.disconnect mid-stream stops an endless body at once and returns quietly."""
    sent, closed = _run_stream(_endless(), leave_after=5)
    assert closed
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert 5 <= len(bodies) <= 7  # stops within a chunk or two of the disconnect
    assert all(m["more_body"] for m in bodies)
