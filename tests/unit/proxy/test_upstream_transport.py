"""`attempt.Upstream` over any `http1.StreamingTransport`: one attempt driven through a
`MockTransport` (no socket), its answer read into the ledger, its failures reported as
the outcome the judgment reads."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.http1 import MockTransport, NoConnection, Reply, Request
from dynamo_ftctl.proxy.attempt import Upstream, UpstreamFailure
from dynamo_ftctl.proxy.balancer import WorkerSlot
from dynamo_ftctl.proxy.ledger import StreamLedger
from dynamo_ftctl.proxy.streams import stream_attempt

URL = "http://127.0.0.1:1/v1/completions"


def _event(text: str, finish: str | None = None) -> bytes:
    doc = {"id": "up", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _sse(*texts: str) -> bytes:
    *head, last = texts
    return b"".join([*(_event(t) for t in head), _event(last, "length"), b"data: [DONE]\n\n"])


def _attempt(transport: MockTransport, *, max_tokens: int = 8) -> tuple[list[str], StreamLedger]:
    ledger = StreamLedger(endpoint="completions", body={
        "model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True})
    slot = WorkerSlot(name="w1", url="http://127.0.0.1:1", model="m", group="g")
    upstream = Upstream(transport, stall_s=5.0, connect_timeout_s=1.0, now=lambda: 0.0)

    async def run() -> list[str]:
        texts = []
        async for batch in stream_attempt(upstream, slot, URL, b"{}", {}, ledger):
            texts += [chunk["choices"][0]["text"] for chunk in batch if isinstance(chunk, dict)]
        return texts

    return asyncio.run(run()), ledger


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text("abc xyz", min_size=1, max_size=4), min_size=1, max_size=8),
       chunk_size=st.integers(1, 200))
def test_any_split_of_the_answer_reads_alike(texts: list[str], chunk_size: int) -> None:
    seen: list[Request] = []

    def handler(request: Request) -> Reply:
        seen.append(request)
        return Reply(200, _sse(*texts), {"content-type": "text/event-stream"})

    out, ledger = _attempt(MockTransport(handler, chunk_size=chunk_size))
    assert out == texts
    assert ledger.generated_text == "".join(texts)
    assert ledger.finish_reason == "length"
    request, = seen
    assert (request.method, request.url, request.timeout_s, request.connect_timeout_s) == \
        ("POST", URL, 5.0, 1.0)


@pytest.mark.parametrize(("reply", "kind", "status"), [
    (Reply(503, b'{"error": "busy"}', {"content-type": "application/json",
                                        "retry-after": "3"}), "status", 503),
    (Reply(200, b"<html>", {"content-type": "text/html"}), "garbage", None),
    (Reply(200, _event("a"), {"content-type": "text/event-stream"}), "garbage", None),
    (Reply(200, b"data: {not json\n\n", {"content-type": "text/event-stream"}), "garbage", None),
])
def test_a_failed_answer_is_reported_as_its_outcome(reply: Reply, kind: str,
                                                   status: int | None) -> None:
    with pytest.raises(UpstreamFailure) as failure:
        _attempt(MockTransport(lambda _request: reply, chunk_size=7))
    outcome = failure.value.outcome
    assert (outcome.kind, outcome.status) == (kind, status)
    if status is not None:
        assert outcome.body == reply.body  # read whole through the transport
        assert outcome.retry_after == "3"


def test_an_error_body_past_its_limit_is_dropped() -> None:
    huge = Reply(500, b"x" * (64 * 1024 + 1), {"content-type": "text/plain"})
    with pytest.raises(UpstreamFailure) as failure:
        _attempt(MockTransport(lambda _request: huge, chunk_size=4096))
    assert (failure.value.outcome.status, failure.value.outcome.body) == (500, b"")


def test_no_connection_is_unreachable() -> None:
    def refuse(request: Request) -> Reply:
        raise NoConnection(f"refused: {request.url}")

    with pytest.raises(UpstreamFailure) as failure:
        _attempt(MockTransport(refuse))
    assert failure.value.outcome.kind == "unreachable"


def _whole(transport: MockTransport, *, max_tokens: int = 8,
           chat: bool = False) -> StreamLedger:
    """One whole-answer attempt (`StreamLedger.whole`) through `transport`."""
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": False}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    ledger = StreamLedger(endpoint="chat" if chat else "completions", body=body)
    ledger.whole = True
    slot = WorkerSlot(name="w1", url="http://127.0.0.1:1", model="m", group="g")
    upstream = Upstream(transport, stall_s=5.0, connect_timeout_s=1.0, now=lambda: 0.0)

    asyncio.run(upstream.whole(slot, URL, b"{}", {}, ledger))
    return ledger


def _answer(text: str, *, ids: int | None = None, chat: bool = False,
            finish: str | None = "length") -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    if ids is not None:
        choice["token_ids"] = list(range(ids))
    return json.dumps({"id": "up", "choices": [choice],
                       "usage": {"prompt_tokens": 2, "completion_tokens": ids or 1}}).encode()


@settings(max_examples=40, deadline=None)
@given(text=st.text("abc xyz", min_size=1, max_size=12), chunk_size=st.integers(1, 300),
       chat=st.booleans(), ids=st.integers(1, 8))
def test_a_whole_answer_split_anywhere_reads_alike(text: str, chunk_size: int, chat: bool,
                                                   ids: int) -> None:
    """A whole answer in any split is recorded in the ledger as its stream would be (a chat's
    message as a delta), and the head is awaited (max_tokens + 1) stalls."""
    seen: list[Request] = []

    def handler(request: Request) -> Reply:
        seen.append(request)
        return Reply(200, _answer(text, ids=ids, chat=chat), {"content-type": "application/json"})

    ledger = _whole(MockTransport(handler, chunk_size=chunk_size), chat=chat)
    assert ledger.generated_text == text
    assert (ledger.generated_count, ledger.finish_reason) == (ids, "length")
    assert ledger.response()["usage"] == {"prompt_tokens": 2, "completion_tokens": ids,
                                          "total_tokens": 2 + ids}
    request, = seen
    assert (request.timeout_s, request.connect_timeout_s) == (5.0 * 9, 1.0)


@pytest.mark.parametrize(("reply", "kind", "status"), [
    (Reply(503, b'{"error": "busy"}', {"content-type": "application/json",
                                        "retry-after": "3"}), "status", 503),
    (Reply(200, b"<html>", {"content-type": "text/html"}), "garbage", None),
    (Reply(200, _sse("a", "b"), {"content-type": "text/event-stream"}), "garbage", None),
    (Reply(200, b"{not json", {"content-type": "application/json"}), "garbage", None),
    (Reply(200, b"[1, 2]", {"content-type": "application/json"}), "garbage", None),
    (Reply(200, _answer("a", ids=9), {"content-type": "application/json"}), "garbage", None),
    (Reply(200, _answer("a", finish=None), {"content-type": "application/json"}),
     "garbage", None),
    (Reply(200, b'{"choices": [], "usage": {"completion_tokens": 0}}',
           {"content-type": "application/json"}), "garbage", None),
    (Reply(200, b'{"error": {"message": "engine dead", "code": 500}}',
           {"content-type": "application/json"}), "event", 500),
])
def test_a_failed_whole_answer_is_reported_as_its_outcome(reply: Reply, kind: str,
                                                          status: int | None) -> None:
    """Anything but a whole completion of at most max_tokens with a finish reason fails
    the attempt, as the same fault in a stream does."""
    with pytest.raises(UpstreamFailure) as failure:
        _whole(MockTransport(lambda _request: reply, chunk_size=5))
    outcome = failure.value.outcome
    assert (outcome.kind, outcome.status) == (kind, status)


def test_a_whole_chat_answer_without_a_message_is_garbage() -> None:
    doc = {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}
    reply = Reply(200, json.dumps(doc).encode(), {"content-type": "application/json"})
    with pytest.raises(UpstreamFailure) as failure:
        _whole(MockTransport(lambda _request: reply), chat=True)
    assert failure.value.outcome.kind == "garbage"
