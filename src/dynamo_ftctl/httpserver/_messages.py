"""What `httpserver` reads and writes: a request, a whole or streamed answer, their bytes.

`Request` is what a handler gets; `Reply` (a whole body, Content-Length) and `Stream`
(chunked, pulled as the client reads) are what it returns; `Pusher` writes a
stream's pieces from any callback. `frame_head`, `frame_chunk` and `error_bytes` frame
HTTP/1.1 bytes. No sockets here: the connection protocol is `_connection`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamo_ftctl.httpserver._connection import Connection

__all__ = ["CHUNKED_END", "Handler", "Pusher", "Reply", "Request", "Stream",
           "error_bytes", "frame_chunk", "frame_head", "status_line"]

_STATUS_LINES: dict[int, bytes] = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus
}
CHUNKED_END = b"0\r\n\r\n"


def frame_chunk(data: bytes) -> bytes:
    """`data` as one piece of a chunked body (not empty: that is the end)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()


@dataclass(slots=True)
class Request:
    """One parsed request (header names lower-cased, the body read whole)."""

    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first header called `name` (lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer, sent with Content-Length."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


class Pusher:
    """Writes pieces of one streamed answer's body to its client at once, from any callback.

    Use it between the pieces `chunks` yields, never while one of them waits to be
    written: check `writable` first (False while the client's socket buffer is above
    its high-water mark, once the client has gone and once the answer has ended);
    a piece it cannot take must come through `chunks`.
    """

    __slots__ = ("_chunked", "_conn", "open")

    def __init__(self, conn: Connection, *, chunked: bool) -> None:
        self._conn = conn
        self._chunked = chunked
        self.open = True  # False once the answer has ended (the connection may serve another)

    @property
    def writable(self) -> bool:
        """A piece written now goes out in order, before anything else of this answer."""
        conn = self._conn
        return self.open and not conn.closed and not conn.writing_paused

    def write(self, data: bytes) -> None:
        """Write `data` as the next piece of the body (only while `writable`)."""
        if data:
            self._conn.write_piece(data, chunked=self._chunked)


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed answer, sent with chunked transfer coding as `chunks` yields.

    `on_push`, when given, is called once the head has gone out, with the `Pusher`
    of this answer (see `Pusher`).
    """

    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream; charset=utf-8"
    headers: Mapping[str, str] = field(default_factory=dict)
    status: int = 200
    on_push: Callable[[Pusher], None] | None = None


Handler = Callable[[Request], Awaitable[Reply | Stream]]


def frame_head(status: int, content_type: str, headers: Mapping[str, str], framing: bytes,
          keep_alive: bool) -> bytes:
    lines = [status_line(status), b"content-type: ", content_type.encode("latin-1"), b"\r\n"]
    lines.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
    lines.append(framing)
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def error_bytes(status: int, message: str, headers: Mapping[str, str] | None = None) -> bytes:
    body = message.encode()
    return frame_head(status, "text/plain; charset=utf-8", headers or {},
                 b"content-length: %d\r\n" % len(body), keep_alive=False) + body

