"""The one SSE codec: events, raw blocks and lines, whatever the reads and line ends."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.sse import (
    SseDecoder,
    SseEvent,
    data_and_comments,
    format_sse,
    iter_sse_events,
    iter_sse_lines,
)


def _reference_events(stream: bytes) -> list[SseEvent]:
    """The WHATWG EventSource algorithm, line by line, as plainly as it reads."""
    events: list[SseEvent] = []
    data: list[str] = []
    name: str | None = None
    last_id: str | None = None
    for line in [*re.split(rb"\r\n|\r|\n", stream), b""]:
        if not line:
            if data:
                events.append(SseEvent("\n".join(data), name, last_id))
            data, name = [], None
            continue
        if line.startswith(b":"):
            continue
        field, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        text = value.decode("utf-8", errors="replace")
        if field == b"data":
            data.append(text)
        elif field == b"event":
            name = text
        elif field == b"id":
            last_id = text
    return events


def _reads(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts})
    return [stream[i:j] for i, j in zip([0, *points], [*points, len(stream)], strict=True)]


_PIECES = [b"data: ", b"data:", b"id: 7", b"event: e", b"x", b"{}", b"\n", b"\n\n", b"\r",
           b"\r\n", b": c", b"\xff"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join),
       st.lists(st.integers(0, 200), max_size=6))
def test_decoder_matches_the_line_by_line_algorithm(stream: bytes, cuts: list[int]) -> None:
    """Events (data, name, last id) equal the spec's line-by-line reading of the whole
    stream, however it is cut into reads (fast paths included)."""
    assert list(iter_sse_events(_reads(stream, cuts))) == _reference_events(stream)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join),
       st.lists(st.integers(0, 200), max_size=6))
def test_feed_data_gives_each_events_data_as_bytes(stream: bytes, cuts: list[int]) -> None:
    """`feed_data` (the proxy's per-token path) yields what `feed` does, each event's data
    only, as bytes that read as that data (bad UTF-8 left for the JSON decoder's fallback)."""
    whole, raw = SseDecoder(), SseDecoder()
    reads = _reads(stream, cuts)
    expected = [event.data for read in reads for event in whole.feed(read)]
    got = [data.decode("utf-8", "replace") for read in reads for data in raw.feed_data(read)]
    assert got == expected


def _reference_comments(stream: bytes) -> list[bytes]:
    """Every comment line's text (after the colon, one leading space dropped)."""
    out = []
    for line in re.split(rb"\r\n|\r|\n", stream):
        if line.startswith(b":"):
            out.append(line[2:] if line.startswith(b": ") else line[1:])
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([*_PIECES, b": x-ftctl-migrated: 2"]), max_size=40)
       .map(b"".join), st.lists(st.integers(0, 200), max_size=6))
def test_data_and_comments_of_raw_blocks_read_as_the_spec(stream: bytes,
                                                         cuts: list[int]) -> None:
    """The raw-block face (`blocks` + `data_and_comments`, the load generator's and the
    drill's) gives each event's data and every comment line as the spec reads them."""
    decoder = SseDecoder()
    blocks = [block for read in _reads(stream, cuts) for block in decoder.blocks(read)]
    blocks.append(decoder.rest())
    read = [data_and_comments(block) for block in blocks]
    data = [d.decode("utf-8", "replace") for d, _ in read if d is not None]
    assert data == [event.data for event in _reference_events(stream)]
    assert [c for _, comments in read for c in comments] == _reference_comments(stream)


def test_a_one_line_event_costs_no_list() -> None:
    assert data_and_comments(b'data: {"a":1}') == (b'{"a":1}', ())
    assert data_and_comments(b": c\ndata:x\ndata: y") == (b"x\ny", (b"c",))
    assert data_and_comments(b": only") == (None, (b"only",))


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from([b"a", b"b", b"\r", b"\n", b":", b" "]),
                     max_size=80).map(b"".join),
       cuts=st.lists(st.integers(0, 80), max_size=4))
def test_lines_do_not_depend_on_reads(text: bytes, cuts: list[int]) -> None:
    """Lines come out the same however the bytes are chunked (LF, CR and CRLF endings)."""
    expected = re.split(rb"\r\n|\r|\n", text)
    if not expected[-1]:
        expected.pop()  # the stream ended with a line end: no partial line after it
    assert list(iter_sse_lines(_reads(text, cuts))) == expected


def test_blocks_are_raw_events_with_lf_line_ends() -> None:
    """`blocks` gives the bytes between blank lines (CR and CRLF made LF), `rest` the tail."""
    decoder = SseDecoder()
    assert decoder.blocks(b"data: a\r\n\r\n: x-c: 2\rdata: b\r") == [b"data: a"]
    assert decoder.blocks(b"\n\rdata: c") == [b": x-c: 2\ndata: b"]
    assert decoder.rest() == b"data: c"
    assert decoder.rest() == b""


def test_a_whole_event_read_keeps_the_stream_id() -> None:
    """The one-event fast path carries the last `id:` seen, as the general path does."""
    decoder = SseDecoder()
    assert decoder.feed(b"id: 9\ndata: a\n\n") == [SseEvent("a", None, "9")]
    assert decoder.feed(b"data: b\n\n") == [SseEvent("b", None, "9")]


def test_format_sse_round_trips_through_the_decoder() -> None:
    """What the encoder writes, the decoder reads back (dicts as compact JSON)."""
    wire = format_sse({"a": [1, 2]}) + format_sse("[DONE]")
    assert wire == b'data: {"a":[1,2]}\n\ndata: [DONE]\n\n'
    events = list(iter_sse_events([wire]))
    assert [e.data for e in events] == ['{"a":[1,2]}', "[DONE]"]
    assert events[1].is_done
