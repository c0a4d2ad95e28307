"""`attempt.Reader`: an upstream answer's bytes, read by read, into the ledger and the
client's chunks (no I/O)."""

from __future__ import annotations

import json

from dynamo_ftctl.proxy.attempt import KvShare, Reader
from dynamo_ftctl.proxy.balancer import WorkerSlot
from dynamo_ftctl.proxy.ledger import StreamLedger


def _reader(body: dict[str, object] | None = None) -> tuple[Reader, StreamLedger, WorkerSlot]:
    ledger = StreamLedger(endpoint="completions", body=body or {
        "model": "m", "prompt": "hi", "max_tokens": 8, "stream": True})
    slot = WorkerSlot(name="w1", url="http://127.0.0.1:1", model="m", group="g")
    return Reader("w1", ledger, 30.0, lambda: 0.0, KvShare(slot, 2)), ledger, slot


def _event(text: str, finish: str | None = None) -> bytes:
    doc = {"id": "up", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def test_one_event_a_read_and_many_a_read_and_split_events_read_alike() -> None:
    events = [_event("a"), _event("b"), _event("c"), _event("d", "length"), b"data: [DONE]\n\n"]
    stream = b"".join(events)
    one_a_read, ledger1, slot1 = _reader()
    chunks = [c for e in events for c in one_a_read.feed(e)]
    split, ledger2, _ = _reader()
    cut = len(events[0]) + 7  # a read ends inside the second event
    chunks2 = split.feed(stream[:cut]) + split.feed(stream[cut:])
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c", "d"]
    assert [c["choices"][0] for c in chunks2] == [c["choices"][0] for c in chunks]
    for reader, ledger in ((one_a_read, ledger1), (split, ledger2)):
        assert reader.done
        assert reader.failure is None
        assert (ledger.generated_text, ledger.generated_count) == ("abcd", 4)
        assert ledger.finish_reason == "length"
    assert chunks[0]["id"] == ledger1.request_id  # the proxy's id, not the worker's
    assert slot1.kv_blocks == 2  # 4 tokens in blocks of 2


def test_bytes_that_are_not_utf8_read_as_replacement_characters() -> None:
    """A worker's event with a byte that is not UTF-8 is read as the SSE text would be
    (U+FFFD), not refused, on the bytes fast path as on the general one."""
    bad = b'data: {"choices":[{"index":0,"text":"a\xffb","finish_reason":null}]}\n\n'
    for pieces in ([bad], [bad[:10], bad[10:]], [bad + _event("c")]):
        reader, ledger, _ = _reader()
        for piece in pieces:
            reader.feed(piece)
        assert reader.failure is None
        assert ledger.generated_text.startswith("a\ufffdb")


def test_generated_text_joins_pieces_once_and_keeps_growing() -> None:
    reader, ledger, _ = _reader({"model": "m", "prompt": "p", "max_tokens": 100,
                                 "stream": True})
    for i in range(50):
        reader.feed(_event(str(i % 10)))
        if i in (10, 30):
            assert ledger.generated_text == "".join(str(j % 10) for j in range(i + 1))
    assert ledger.generated_text == "".join(str(j % 10) for j in range(50))
    assert ledger.generated_count == 50
