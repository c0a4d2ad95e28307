"""Vendor extensions through the proxy: unknown chunk and choice fields, `event:` blocks and
SSE comments reach the client unchanged and in order (issue 31), without a failed
attempt's blocks leaking."""

from __future__ import annotations

import json
from typing import Any

from dynamo_ftctl.proxy.attempt import KvShare, Reader
from dynamo_ftctl.proxy.balancer import WorkerSlot
from dynamo_ftctl.proxy.codec import sse_batch
from dynamo_ftctl.proxy.ledger import StreamLedger
from dynamo_ftctl.sse import RelayBlock, SseDecoder


def _reader(stream: bool = True) -> tuple[Reader, StreamLedger]:
    ledger = StreamLedger(endpoint="completions", body={
        "model": "m", "prompt": "hi", "max_tokens": 8, "stream": stream})
    slot = WorkerSlot(name="w1", url="http://127.0.0.1:1", model="m", group="g")
    return Reader("w1", ledger, 30.0, lambda: 0.0, KvShare(slot, 2)), ledger


def _event(text: str, finish: str | None = None, **top: Any) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "vendor_choice": {"k": 1}}
    doc = {"id": "up", "object": "text_completion", "created": 1, "model": "m",
           "choices": [choice], **top}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


TOKEN_IDS = b"event: token_ids\n: [1,2,3]\n\n"
COMMENT = b": keep-alive\n\n"


def test_decoder_relays_named_and_comment_blocks_raw_and_plain_events_as_data() -> None:
    """`feed_relay`: data events give their data; `event:` and comment blocks their bytes."""
    decoder = SseDecoder()
    items = decoder.feed_relay(b'data: {"a":1}\n\n' + TOKEN_IDS + COMMENT
                               + b"event: message\ndata: {}\n\nevent: x\ndata: 7\n\n")
    assert items[0] == b'{"a":1}'
    assert isinstance(items[1], RelayBlock)
    assert (items[1].raw, items[1].event) == (TOKEN_IDS, "token_ids")
    assert isinstance(items[2], RelayBlock)
    assert (items[2].raw, items[2].event) == (COMMENT, None)
    assert items[3] == b"{}"
    assert isinstance(items[4], RelayBlock)
    assert items[4].raw == b"event: x\ndata: 7\n\n"


def test_nvext_and_vendor_keys_reach_the_client_chunk_unchanged() -> None:
    """A chunk-level `nvext` and a choice-level vendor key pass; the worker's id does not."""
    reader, ledger = _reader()
    nvext = {"worker_id": {"prefill_worker_id": 3}, "timing": {"ttft_ms": 1.5}}
    [chunk] = reader.feed(_event("a", nvext=nvext, x_vendor=[1, "two"]))
    assert isinstance(chunk, dict)
    assert chunk["nvext"] == nvext
    assert chunk["x_vendor"] == [1, "two"]
    assert chunk["choices"][0]["vendor_choice"] == {"k": 1}
    assert chunk["id"] == ledger.request_id


def test_event_blocks_and_comments_go_out_in_order_with_the_chunks() -> None:
    """Blocks before the first token wait for it; later ones keep their place."""
    reader, _ = _reader()
    pieces = (reader.feed(TOKEN_IDS) + reader.feed(_event("a") + COMMENT + _event("b"))
              + reader.feed(TOKEN_IDS + _event("c", "length") + b"data: [DONE]\n\n"))
    kinds = [p if isinstance(p, bytes) else p["choices"][0]["text"] for p in pieces]
    assert kinds == [TOKEN_IDS, "a", COMMENT, "b", TOKEN_IDS, "c"]
    assert reader.done
    out = sse_batch(pieces)
    assert out.startswith(TOKEN_IDS + b"data: ")
    assert COMMENT in out


def test_a_failed_attempts_blocks_before_its_first_chunk_never_reach_the_client() -> None:
    """An attempt that dies before any chunk sends nothing, its held blocks included."""
    reader, _ = _reader()
    assert reader.feed(TOKEN_IDS + COMMENT) == []
    assert reader.failure is None  # held, not sent


def test_dynamo_error_event_is_a_failure_not_output() -> None:
    """`event: error` with its message in comments (Dynamo's form) fails the attempt."""
    reader, _ = _reader()
    reader.feed(_event("a"))
    assert reader.feed(b"event: error\n: engine died\n\n") == []
    assert reader.failure is not None
    assert "engine died" in str(reader.failure)


def test_a_client_that_does_not_stream_gets_no_relayed_blocks() -> None:
    """A non-streamed answer is one JSON document: relayed blocks have no place in it."""
    reader, ledger = _reader(stream=False)
    pieces = reader.feed(TOKEN_IDS + _event("a", "length", nvext={"x": 1}) + b"data: [DONE]\n\n")
    assert not any(isinstance(p, bytes) for p in pieces)
    assert ledger.generated_text == "a"
