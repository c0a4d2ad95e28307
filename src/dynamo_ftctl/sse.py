"""Server-Sent Events: the one decoder and the one encoder of the package.

Every SSE reader (the proxy's upstream streams, the load generator, calibration,
KV transfer, canary judging, tests) splits bytes with `SseDecoder`, and every
writer that builds events one at a time uses `format_sse`. The decoder has two
faces over one splitter:

- `SseDecoder.feed` / `flush`: `SseEvent`s (data, event name, last id), per the
  WHATWG EventSource rules the package needs: lines end with LF, CRLF or CR; a
  blank line dispatches; `:` lines are comments; `data:` lines join with LF.
- `SseDecoder.blocks` / `rest`: the raw events, the bytes between blank lines
  with LF line ends, for a reader that looks at its own fields (the load
  generator reads `data:` bytes and the proxy's `: x-ftctl-migrated` comment
  without building an event per token).
- `SseDecoder.feed_relay`: the proxy's face: each plain event's data as bytes,
  and every other block (a named `event:`, comments, an event without data) as
  a `RelayBlock` holding its raw bytes, to pass on unchanged.

The splitter normalises line ends once per read and cuts events with
`bytes.split` (an event per streamed token: no per-byte Python loop). A CR that
ends a read turns into LF at once; an LF that opens the next read is then that
CRLF's and is dropped.

Pure bytes in and out: no I/O, nothing heavy imported (`openai` re-exports
these names for the callers that know them from there).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec

__all__ = [
    "DONE",
    "RelayBlock",
    "SseDecoder",
    "SseEvent",
    "data_and_comments",
    "format_sse",
    "iter_sse_events",
    "iter_sse_lines",
]

DONE = "[DONE]"
"""The data of the last event of an OpenAI stream."""


class SseEvent(msgspec.Struct, frozen=True):
    """One dispatched SSE event (fields per the WHATWG EventSource spec)."""

    data: str
    event: str | None = None
    id: str | None = None

    @property
    def is_done(self) -> bool:
        """True for OpenAI's closing `data: [DONE]`."""
        return self.data.strip() == DONE


class RelayBlock:
    """An SSE block that is not a plain data event: a named `event:` (Dynamo's
    `event: token_ids`), comment lines, or fields without data.

    `raw` is the block as it came, line ends made LF, with its closing blank line:
    what a relay writes unchanged. `event` is its `event:` name (None without one).
    """

    __slots__ = ("event", "raw")

    def __init__(self, raw: bytes, event: str | None) -> None:
        self.raw = raw
        self.event = event

    def __repr__(self) -> str:
        return f"RelayBlock({self.raw!r})"


class SseDecoder:
    """Incremental SSE decoder: feed arbitrary byte chunks, get complete events.

    Use one face per decoder: `feed`/`flush` (events) or `blocks`/`rest` (raw
    events); both share the buffer.
    """

    __slots__ = ("_buf", "_id", "_skip_lf")

    def __init__(self) -> None:
        self._buf = b""  # bytes after the last blank line, line ends already LF
        self._skip_lf = False  # the last read ended in CR: an LF first is its CRLF's
        self._id: str | None = None  # ids last for the whole stream (WHATWG)

    def _take(self, chunk: bytes) -> bytes:
        """The buffer plus `chunk`, line ends made LF."""
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return buf

    def blocks(self, chunk: bytes) -> list[bytes]:
        """Add bytes; the raw events they complete (LF line ends, no blank line)."""
        if self._buf or self._skip_lf or b"\r" in chunk:  # else `_take` would return `chunk`
            chunk = self._take(chunk)
        events = chunk.split(b"\n\n")
        self._buf = events.pop()
        return events

    def rest(self) -> bytes:
        """End of stream: a last raw event that lacked its blank line (b"" if none)."""
        rest = self._buf.strip(b"\n")
        self._buf = b""
        return rest

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Add bytes; return the events they complete."""
        data = self._lone_event(chunk)
        if data is not None:  # once per streamed token: no split, no list of one
            return [SseEvent(data.decode("utf-8", errors="replace"), None, self._id)]
        events: list[SseEvent] = []
        for block in self.blocks(chunk):
            event = self._event(block)
            if event is not None:
                events.append(event)
        return events

    def feed_data(self, chunk: bytes) -> list[bytes]:
        """`feed`, but only each event's data, as UTF-8 bytes: what a JSON decoder takes
        without a str in between (the proxy reads every token's event this way)."""
        data = self._lone_event(chunk)
        if data is not None:
            return [data]
        out: list[bytes] = []
        for block in self.blocks(chunk):
            data = _plain_data(block)
            if data is None:
                event = self._event(block)
                if event is None:
                    continue
                data = event.data.encode()
            out.append(data)
        return out

    def feed_relay(self, chunk: bytes) -> list[bytes | RelayBlock]:
        """`feed_data` for a relay: a plain event (no name, or `message`, or `error`)
        gives its data as bytes; any other block, a `RelayBlock` with its raw bytes.

        An empty block (a run of blank lines) gives nothing. Costs what `feed_data`
        does for plain events: the named and comment blocks alone are looked into.
        """
        data = self._lone_event(chunk)
        if data is not None:
            return [data]
        out: list[bytes | RelayBlock] = []
        for block in self.blocks(chunk):
            data = _plain_data(block)
            if data is not None:
                out.append(data)
                continue
            name, lines = _named(block)
            if lines is not None and name in (None, "message", "error"):
                out.append("\n".join(lines).encode())
            elif block.strip(b"\n"):
                out.append(RelayBlock(block.strip(b"\n") + b"\n\n", name))
        return out

    def _lone_event(self, chunk: bytes) -> bytes | None:
        """The data of `chunk` when it is one whole one-line `data:` event and nothing is
        buffered: what a server sends a read at a time."""
        if not self._buf and not self._skip_lf and chunk.startswith(b"data: ") \
                and chunk.endswith(b"\n\n") and chunk.find(b"\n") == len(chunk) - 2 \
                and b"\r" not in chunk:
            return chunk[6:-2]
        return None

    def flush(self) -> list[SseEvent]:
        """End of stream: dispatch a last event that lacked its blank line."""
        event = self._event(self.rest())
        return [] if event is None else [event]

    def _event(self, block: bytes) -> SseEvent | None:
        plain = _plain_data(block)
        if plain is not None:
            return SseEvent(plain.decode("utf-8", errors="replace"), None, self._id)
        data: list[str] = []
        name: str | None = None
        # A blank line can only open a block (after a run of them): it dispatches nothing.
        for line in block.split(b"\n"):
            if not line or line.startswith(b":"):
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
                self._id = text
        if not data:
            return None
        return SseEvent("\n".join(data), name, self._id)


def _named(block: bytes) -> tuple[str | None, list[str] | None]:
    """A block's `event:` name and its data lines (None when it has no `data:` field)."""
    data: list[str] | None = None
    name: str | None = None
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            if data is None:
                data = []
            data.append(value.decode("utf-8", errors="replace"))
        elif field == b"event":
            name = value.decode("utf-8", errors="replace")
    return name, data


def _plain_data(block: bytes) -> bytes | None:
    """The data of a raw event that is one `data: ` line (nearly every event), else None."""
    return block[6:] if block.startswith(b"data: ") and b"\n" not in block else None


_NO_COMMENTS: tuple[bytes, ...] = ()


def data_and_comments(block: bytes) -> tuple[bytes | None, tuple[bytes, ...]]:
    """A raw event's data (its `data:` lines joined by LF; None when it has none) and its
    comment lines (after the colon, one leading space dropped), as the spec reads them.

    A one-line `data: ` event, nearly every event, costs one slice and no list.
    """
    plain = _plain_data(block)
    if plain is not None:
        return plain, _NO_COMMENTS
    data: list[bytes] = []
    comments: list[bytes] = []
    for line in block.split(b"\n"):
        field, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif not field and sep:
            comments.append(value)
    return (b"\n".join(data) if data else None), tuple(comments)


def iter_sse_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split a byte stream into lines (LF, CRLF or CR), whatever the chunking."""
    decoder = SseDecoder()
    for chunk in chunks:
        lines = decoder._take(chunk).split(b"\n")
        decoder._buf = lines.pop()
        yield from lines
    if decoder._buf:
        yield decoder._buf


def iter_sse_events(chunks: Iterable[bytes]) -> Iterator[SseEvent]:
    """The SSE events of a byte stream, whatever the chunking."""
    decoder = SseDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)
    yield from decoder.flush()


def format_sse(payload: Mapping[str, Any] | str) -> bytes:
    """One `data: ...` event as bytes (a dict is written as compact JSON)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"
