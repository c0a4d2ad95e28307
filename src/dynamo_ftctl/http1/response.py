"""A streamed answer for awaiting code, and reading a body whole.

`Response` is the `Exchange` a `Pool.request` returns once the headers are in:
its body chunk by chunk (`next_chunk`, with a stall timeout and backpressure:
the socket stops being read while 256 KiB wait unread) or whole (`read`, with a
size limit). `close()` before the end hangs up (the way to cancel). A `sink` may
take body pieces in the socket's callback instead, while none wait unread (the
proxy's fast lane: no task wakes per piece).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dynamo_ftctl.http1.connection import Exchange
from dynamo_ftctl.http1.errors import BodyTooLarge, HttpError
from dynamo_ftctl.http1.transport import DEFAULT_LIMIT, ReplyStream

if TYPE_CHECKING:
    from dynamo_ftctl.http1.connection import Connection

__all__ = ["DEFAULT_LIMIT", "Response", "Sink", "read_whole"]

# Unread body bytes of a `Response` above which its socket stops being read.
_HIGH_WATER = 256 * 1024

Sink = Callable[[bytes], bool]


class Response(Exchange):
    """A streamed answer: headers first, then its body as it comes.

    `sink`: while set, the body bytes of each socket read that finds none waiting
    unread go to `sink(piece)` in the socket's callback, once the read is parsed (a
    read's de-chunked pieces joined: several events, one call, one write onward).
    It returns False to leave the piece for `next_chunk` (then, in order,
    everything after it too until it is read). A sink that has taken its last
    piece calls `end_sink()`: `next_chunk` then returns b"" once (the reader looks
    at what the sink left), and the body's later pieces are buffered again. The
    stall timeout of a `next_chunk` counts from the last piece that arrived, taken
    by the sink or not.
    """

    __slots__ = ("_buffered", "_chunks", "_error", "_for_sink", "_loop", "_sink_ended",
                 "_timer", "_waiter", "body_at", "complete", "connection", "headers",
                 "last_read", "sent_at", "sink")

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.connection = conn
        self._loop = asyncio.get_running_loop()
        self.headers: dict[bytes, bytes] = {}
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: HttpError | None = None
        self.complete = False
        # time.monotonic() when the request was written and when its body began.
        self.sent_at: float | None = None
        self.body_at: float | None = None
        self.last_read = 0.0  # time.monotonic() of the last body piece
        self.sink: Sink | None = None
        self._for_sink: list[bytes] = []  # this read's pieces, for the sink at its end
        self._sink_ended = False
        self._timer: asyncio.TimerHandle | None = None

    # -- what the connection reports
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name] = value

    def on_headers(self) -> None:
        self._wake()

    def on_body(self, data: bytes) -> None:
        self.last_read = now = time.monotonic()
        if self.body_at is None:
            self.body_at = now
        if self.sink is not None and not self._chunks:
            self._for_sink.append(data)
            return
        self._buffer(data)

    def _buffer(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self.connection.pause()

    def on_read_end(self) -> None:
        pieces = self._for_sink
        if pieces:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            sink = self.sink
            if sink is None or not sink(data):
                self._buffer(data)
        if self._chunks:
            self._wake()

    def on_complete(self) -> None:
        self.complete = True
        self._wake()

    def on_failure(self, error: HttpError) -> None:
        self._for_sink.clear()  # a read that broke the framing: the answer is lost anyway
        self._error = error
        self._wake()

    def end_sink(self) -> None:
        """The sink took its last piece: `next_chunk` returns b"" once, now or next."""
        self.sink = None
        self._sink_ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self, waiter: asyncio.Future[None], started: float, timeout_s: float) -> None:
        self._timer = None
        if waiter.done():
            return
        # Pieces a sink took count as reads: wait on from the last one.
        idle = time.monotonic() - max(started, self.last_read)
        if idle < timeout_s:
            self._timer = self._loop.call_later(timeout_s - idle, self._expire, waiter,
                                                started, timeout_s)
            return
        waiter.set_exception(TimeoutError(f"nothing read for {timeout_s:g} s"))

    async def _wait(self, timeout_s: float | None) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        if timeout_s is not None:
            self._timer = self._loop.call_later(timeout_s, self._expire, waiter,
                                                time.monotonic(), timeout_s)
        try:
            await waiter
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    # -- what the reader calls
    @property
    def body_wait_s(self) -> float | None:
        """Seconds from writing the request to the first byte of the answer's body.

        For a worker's stream, its time to first token as seen from here: no
        parsing or scheduling on this side is counted (both ends are stamped in
        the connection's callbacks). None until the body begins.
        """
        if self.sent_at is None or self.body_at is None:
            return None
        return self.body_at - self.sent_at

    def header(self, name: str) -> str | None:
        """A response header (`name` in lower case), or None."""
        value = self.headers.get(name.encode("latin-1"))
        return None if value is None else value.decode("latin-1")

    async def wait_headers(self, timeout_s: float | None) -> None:
        """Wait for the status line and headers (`TimeoutError` after `timeout_s`)."""
        while not self.got_headers:
            if self._error is not None:
                raise self._error
            await self._wait(timeout_s)

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        """The body bytes read since the last call (b"" at the end).

        Waits at most `timeout_s` for bytes (`TimeoutError`); raises the
        connection's `HttpError` once what came before it has been read. Returns
        b"" once, too, when a sink has ended (`end_sink`).
        """
        while True:
            if self._sink_ended:
                self._sink_ended = False
                return b""
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                self.connection.resume()
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait(timeout_s)

    async def read(self, limit: int = DEFAULT_LIMIT, timeout_s: float | None = None) -> bytes:
        """The whole body (`BodyTooLarge` past `limit` bytes; `timeout_s` between reads)."""
        return await read_whole(self, limit, timeout_s)

    async def wait_complete(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the end of the body, which is read and dropped."""
        with contextlib.suppress(TimeoutError, HttpError):
            async with asyncio.timeout(timeout_s):
                while await self.next_chunk():
                    pass
        return self.complete

    def close(self) -> None:
        """Done with the answer: before its end, the connection is closed, not reused."""
        self.sink = None
        if self.connection.exchange is self:
            self.connection.abandon()
        self._chunks.clear()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


async def read_whole(response: ReplyStream, limit: int, timeout_s: float | None) -> bytes:
    """The rest of `response`'s body, from any transport's `ReplyStream` (`BodyTooLarge`,
    and hung up, past `limit` bytes)."""
    parts: list[bytes] = []
    size = 0
    while piece := await response.next_chunk(timeout_s):
        size += len(piece)
        if size > limit:
            response.close()
            msg = f"body larger than {limit:,} bytes"
            raise BodyTooLarge(msg)
        parts.append(piece)
    return b"".join(parts)


