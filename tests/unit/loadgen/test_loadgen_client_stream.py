"""SSE streams as the clients read them: the per-event fast path agrees with the shared
`openai` helpers, byte splitting is independent of chunking, Retry-After is parsed."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.loadgen.client import SERVER_TTFT_FIELD, SseStream, _StreamState
from dynamo_ftctl.loadgen.record import retry_after_s
from dynamo_ftctl.openai import (
    SseEvent,
    extract_finish_reason,
    extract_text,
    extract_usage,
    parse_error_body,
)

_values = st.one_of(st.none(), st.text(max_size=3), st.integers(-1, 2), st.booleans())
_parts = st.one_of(_values, st.fixed_dictionaries({}, optional={"content": _values,
                                                                "role": _values}))
_choice = st.one_of(_values, st.fixed_dictionaries({}, optional={
    "index": st.one_of(st.integers(0, 1), st.none()), "text": _values, "delta": _parts,
    "message": _parts, "finish_reason": st.one_of(st.none(), st.sampled_from(["", "length"]),
                                                  st.integers(0, 1))}))
_doc = st.fixed_dictionaries({}, optional={
    "choices": st.one_of(_values, st.lists(_choice, max_size=2)),
    "usage": st.one_of(_values, st.fixed_dictionaries(
        {"completion_tokens": st.integers(0, 5)})),
    "error": st.one_of(st.none(), st.text(max_size=2), st.just({"message": "boom"})),
    "object": st.sampled_from(["text_completion", "error"]),
    "message": st.just("m"),
    SERVER_TTFT_FIELD: st.one_of(st.none(), st.booleans(), st.floats(0, 100), st.text()),
})


def _reference(doc: dict[str, Any]) -> tuple[bool, bool, str | None, int | None, float | None,
                                             int]:
    """What the stream state must conclude from one event, by the general helpers."""
    api_error = parse_error_body(doc)
    if api_error is not None:
        return True, False, f"SSE error event: {api_error}", None, None, 0
    stamped = 1 if extract_text(doc) else 0
    finished = bool(extract_finish_reason(doc))
    server = doc.get(SERVER_TTFT_FIELD) if finished else None
    if isinstance(server, bool) or not isinstance(server, int | float):
        server = None
    usage = extract_usage(doc)
    tokens = usage.completion_tokens if usage is not None and usage.completion_tokens else None
    return (False, finished, None, tokens, None if server is None else server / 1000.0,
            stamped)


@settings(max_examples=500, deadline=None)
@given(doc=_doc)
def test_fast_path_equals_the_general_helpers(doc: dict[str, Any]) -> None:
    """For any chunk shape: same stamp, finish, usage, server TTFT and error as the helpers."""
    state = _StreamState()
    stamps: list[float] = []
    over = state.take(SseEvent(json.dumps(doc)), 1.5, stamps)
    assert (over, state.finished, state.error, state.usage_tokens, state.server_ttft,
            len(stamps)) == _reference(doc)


def test_a_stream_is_judged_by_its_events() -> None:
    """Tokens stamp, the finish chunk's server TTFT is kept, [DONE] ends it as ok."""
    state = _StreamState()
    stamps: list[float] = []
    chunks = [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}],
         SERVER_TTFT_FIELD: 12.5},
        {"choices": [], "usage": {"completion_tokens": 3}},
    ]
    for t, chunk in enumerate(chunks):
        assert not state.take(SseEvent(json.dumps(chunk)), float(t), stamps)
    assert state.take(SseEvent("[DONE]"), 9.0, stamps)
    assert stamps == [0.0, 2.0]
    assert state.verdict() == ("ok", None, 3, 0.0125)


_token = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
_finish = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
           SERVER_TTFT_FIELD: 4.0}
_usage = {"choices": [], "usage": {"completion_tokens": 3}}


def _stream_bytes(newline: bytes, migrated: bool) -> bytes:
    events = [b"data: " + json.dumps(doc).encode() + b"\n\n"
              for doc in (_token, _token, _token, _finish, _usage)]
    events.insert(1, b": keep-alive\n\n")  # a comment between events is nothing
    events.insert(2, b"event: x\ndata: " + json.dumps(_token).encode() + b"\n\n")
    if migrated:
        events.append(b": x-ftctl-migrated: 2\n\n")
    return (b"".join(events) + b"data: [DONE]\n\n").replace(b"\n", newline)


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, 2000), max_size=12),
       newline=st.sampled_from([b"\n", b"\r\n", b"\r"]), migrated=st.booleans())
def test_sse_stream_is_the_same_in_any_pieces(cuts: list[int], newline: bytes,
                                              migrated: bool) -> None:
    """However the bytes are cut and whatever the line ends, the stream reads the same
    tokens, finish, usage, server TTFT and trailing migration comment."""
    data = _stream_bytes(newline, migrated)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    stamps: list[float] = []
    sse = SseStream(stamps)
    over = False
    for n, (a, b) in enumerate(itertools.pairwise(points)):
        over = sse.feed(data[a:b], float(n))
    assert over
    assert len(stamps) == 4
    assert sse.end(99.0) == ("ok", None, 3, 0.004)
    assert sse.migrated == (2 if migrated else 0)


def test_sse_stream_without_blank_line_at_the_end() -> None:
    """A last event cut short of its blank line is still read when the body ends."""
    stamps: list[float] = []
    sse = SseStream(stamps)
    assert not sse.feed(b"data: " + json.dumps(_finish).encode() + b"\r", 1.0)
    assert sse.end(2.0) == ("ok", None, None, 0.004)


def test_malformed_sse_data_breaks_the_stream() -> None:
    """Data that is not JSON ends the stream as broken; NaN (json takes it) does not."""
    sse = SseStream([])
    assert not sse.feed(b'data: {"choices": [], "x": NaN}\n\n', 1.0)
    assert sse.feed(b"data: {nope\n\n", 1.0)
    assert sse.end(2.0)[:2] == ("broken_stream", "malformed SSE data")


@pytest.mark.parametrize(("status", "value", "expected"), [
    (429, "3", 3.0), (503, b" 10 ", 10.0), (529, "1.5", 1.5), (500, "3", None),
    (429, None, None), (429, "soon", None), (429, "-1", None), (429, "nan", None),
    (503, "Thu, 01 Jan 1970 00:01:40 GMT", 40.0), (503, "Thu, 01 Jan 1970 00:00:10 GMT", 0.0),
])
def test_retry_after_seconds(status: int, value: str | bytes | None,
                             expected: float | None) -> None:
    """Retry-After is kept for shed statuses only, as seconds or an HTTP date from now."""
    assert retry_after_s(status, value, wall=60.0) == expected
