"""One client connection of `httpserver`: an asyncio protocol over httptools' parser.

It parses requests (heads up to 64 KiB, bodies up to the server's `max_body`),
counts their bytes against the server's `max_buffered`, runs one handler task at
a time (pipelined requests wait their turn, reading paused), writes `Reply` and
`Stream` answers with backpressure, and enforces the idle and request timeouts
(408 for a request not read whole in time). What it refuses it answers and then
hangs up. The server (`Server`) owns the listening socket and the caps' figures.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import httptools

from dynamo_ftctl.httpserver._messages import (
    CHUNKED_END,
    Pusher,
    Reply,
    Request,
    Stream,
    error_bytes,
    frame_chunk,
    frame_head,
)

if TYPE_CHECKING:
    from dynamo_ftctl.httpserver import Server

__all__ = ["Connection"]

log = logging.getLogger("ftctl.httpserver")

# Connections over the cap being answered 503 hold their descriptor until the client has
# read the answer, at most this long.
_REFUSE_LINGER_S = 1.0
# Request line and headers together: as much as common servers allow (nginx: 4 x 8 KiB).
_MAX_HEAD = 64 * 1024
# The client socket's write buffer above which a `Stream` is no longer pulled.
_WRITE_HIGH_WATER = 64 * 1024


class Connection(asyncio.Protocol):
    """One client connection: parses requests and runs one handler task at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.task: asyncio.Task[None] | None = None
        # Requests read but not yet answered: (request, keep-alive, HTTP/1.1, bytes held).
        self.pending: deque[tuple[Request, bool, bool, int]] = deque()
        self.closed = False
        self.discarding = False  # after a 400/413: ignore the rest of the input
        self.held = 0  # request bytes this connection counts in `Server.buffered`
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._message_bytes = 0  # of `held`: the request being read
        # An upgrade request whose body llhttp leaves unread (see `on_message_complete`).
        self._raw_request: tuple[Request, bool, bool] | None = None
        self._raw_left = 0
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._head_sent = False
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None  # loop time of the idle or request timeout
        self._reading = False  # a request's first byte came, its last not yet

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        if self.server.stopping:  # handed over as the server stopped accepting
            self.transport.abort()
            return
        if len(self.server.connections) >= self.server.max_connections:
            self._refuse()
            return
        self.server.connections.add(self)
        self._arm(self.server.idle_timeout_s)

    def _refuse(self) -> None:
        """Answer 503 to a connection over the cap at once, then hang up."""
        server = self.server
        server.refused_connections += 1
        self.discarding = True
        assert self.transport is not None
        if len(server.refusing) >= server.max_refusing:
            self.transport.close()  # a flood: no descriptor is held for an answer
            return
        server.refusing.add(self)
        self.transport.write(error_bytes(
            503, f"over {server.max_connections} connections; retry later",
            {"retry-after": "1"}))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        # What the client sends meanwhile is read and dropped until it hangs up: a close
        # with its request unread would reset the connection, and the reset can reach the
        # client before the answer does.
        self._timer = self.loop.call_later(_REFUSE_LINGER_S, self.hang_up)

    def data_received(self, data: bytes) -> None:
        while data and not self.discarding:
            if self._raw_left:
                data = self._read_raw_body(data)
                continue
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                # The upgrade request is complete (`on_message_complete`); what follows
                # it is HTTP/1.1 again, for a new parser (this one stopped for good).
                data = data[cast("int", exc.args[0]):]
                self.parser = httptools.HttpRequestParser(self)
                continue
            except httptools.HttpParserError as exc:
                if not self.discarding:
                    self.fail(400, f"malformed HTTP request: {exc}")
            return

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002
        self.closed = True
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.server.connections.discard(self)
        self.server.refusing.discard(self)
        self.pending.clear()
        self._body = []
        self._raw_request = None
        self._release(self.held)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client hung up: its upstream request ends now
        self._wake_writer()

    @property
    def writing_paused(self) -> bool:
        """The client's socket buffer is above its high-water mark (its `Stream` waits)."""
        return self._write_paused

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiter = self._drained
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- accounting of buffered request bytes
    def _over_budget(self, size: int) -> bool:
        """True (and the request answered 503) when `size` more bytes would take the
        server over `max_buffered`."""
        server = self.server
        if server.buffered + size <= server.max_buffered:
            return False
        self.fail(503, f"this server holds {server.max_buffered:,} bytes of requests "
                       "not yet answered; retry later", {"retry-after": "1"})
        return True

    def _hold(self, size: int) -> bool:
        """Count `size` more bytes of the request being read; False when refused (503)."""
        if self._over_budget(size):
            return False
        server = self.server
        server.buffered += size
        self.held += size
        self._message_bytes += size
        return True

    def _release(self, size: int) -> None:
        size = min(size, self.held)
        self.held -= size
        self.server.buffered -= size

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._reading = True
        self._arm(self.server.request_timeout_s)
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._message_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._size += len(url)
        if self._size > _MAX_HEAD:
            self.fail(431, "request line too long")
            raise httptools.HttpParserError("head too large")  # stops this feed_data
        if not self._hold(len(url)):
            raise httptools.HttpParserError("buffers full")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._size += len(name) + len(value)
        if self._size > _MAX_HEAD:
            self.fail(431, "request headers too large")
            raise httptools.HttpParserError("head too large")
        if not self._hold(len(name) + len(value)):
            raise httptools.HttpParserError("buffers full")

    def on_headers_complete(self) -> None:
        self._size = 0
        length = self._declared_length()
        if length > self.server.max_body:
            self.too_large()
        if length and self._over_budget(length):  # refused before it is sent
            raise httptools.HttpParserError("buffers full")
        for name, value in self._headers:
            if name == b"expect" and value.lower() == b"100-continue" \
                    and self.transport is not None:
                # curl and some SDKs wait for this (1 s in curl) before sending a body.
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _declared_length(self) -> int:
        """The Content-Length of the request being read (0 without one; llhttp checked it)."""
        for name, value in self._headers:
            if name == b"content-length" and value.strip().isdigit():
                return int(value)
        return 0

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            self.too_large()
        if not self._hold(len(body)):
            raise httptools.HttpParserError("buffers full")
        self._body.append(body)

    def on_message_complete(self) -> None:
        # Any: httptools' stubs say bytes where an absent part is None, and a compiled
        # build (mypyc) would check the stubs' word.
        parts: Any = httptools.parse_url(self._url)
        path: bytes | None = parts.path
        query: bytes | None = parts.query
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            method=self.parser.get_method().decode("latin-1"),
            path=(path or b"/").decode("latin-1"),
            query=(query or b"").decode("latin-1"),
            headers=self._headers, body=body, client=self.client,
        )
        self._body = []
        keep_alive = self.parser.should_keep_alive()
        # HTTP/1.0 has no chunked coding: a stream to such a client ends with the connection.
        http11 = self.parser.get_http_version() != "1.0"
        if self.parser.should_upgrade():
            # The upgrade is ignored (RFC 9110 7.8: "a server MAY ignore a received
            # Upgrade"), but llhttp stops at the request's head: its body is read by
            # `_read_raw_body` and the rest by a new parser (`data_received`).
            if request.method == "CONNECT":
                keep_alive = False  # what follows is a tunnel's, not HTTP
            elif any(name == b"transfer-encoding" for name, _ in self._headers):
                self.fail(400, "an Upgrade request with a chunked body is not supported")
                raise httptools.HttpParserError("chunked upgrade")
            length = self._declared_length()
            if length:
                self._raw_request = (request, keep_alive, http11)
                self._raw_left = length
                return
        self._dispatch(request, keep_alive, http11)

    def _read_raw_body(self, data: bytes) -> bytes:
        """Take the next bytes of an upgrade request's body from `data`; the rest of it."""
        piece = data[:self._raw_left]
        if not self._hold(len(piece)):
            return b""
        self._raw_left -= len(piece)
        self._body.append(piece)
        if not self._raw_left and self._raw_request is not None:
            request, keep_alive, http11 = self._raw_request
            self._raw_request = None
            request.body = b"".join(self._body)
            self._body = []
            self._dispatch(request, keep_alive, http11)
        return data[len(piece):]

    def _dispatch(self, request: Request, keep_alive: bool, http11: bool) -> None:
        """Answer `request` now, or after those before it (pipelined)."""
        self._reading = False
        self._disarm()
        size = self._message_bytes
        self._message_bytes = 0
        if self.task is None:
            self.task = self.loop.create_task(self._answer(request, keep_alive, http11, size))
            self.server.tasks.add(self.task)
        else:  # pipelined: answered in order; stop reading until its turn
            self.pending.append((request, keep_alive, http11, size))
            if keep_alive is False:
                self.discarding = True
            assert self.transport is not None
            self.transport.pause_reading()
        if request.method == "CONNECT":
            self.discarding = True

    # -- timeouts
    # A timeout is armed and disarmed twice a request (request, then idle): the timer
    # is not cancelled and made again each time (two timer handles a request show in
    # the proxy's profile on short requests) but kept while it fires no later than the
    # deadline; when it fires early, it is set again for the deadline.
    def _arm(self, seconds: float) -> None:
        if seconds <= 0 or self.closed:
            self._deadline = None
            return
        deadline = self.loop.time() + seconds
        self._deadline = deadline
        timer = self._timer
        if timer is not None and timer.when() <= deadline:
            return
        if timer is not None:
            timer.cancel()
        self._timer = self.loop.call_at(deadline, self._timed_out)

    def _disarm(self) -> None:
        self._deadline = None  # the timer, if it fires, finds no deadline

    def _timed_out(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self.closed:
            return
        if self.loop.time() < deadline:  # armed again since: wait for the new deadline
            self._timer = self.loop.call_at(deadline, self._timed_out)
            return
        self._deadline = None
        if self.task is not None:
            return  # answering: the idle or request clock starts again after the answer
        if self._reading:
            self.fail(408, f"request not received within {self.server.request_timeout_s:g} s")
        else:
            self.hang_up()  # idle: the client may reconnect at any time

    # -- answering
    def too_large(self) -> None:
        self.fail(413, f"request body larger than {self.server.max_body:,} bytes")
        raise httptools.HttpParserError("body too large")

    def fail(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        """Answer a request this server refuses, then hang up (nothing more is read)."""
        self.discarding = True
        self._body = []  # what was read of it is dropped now, not at the hang-up
        self._raw_request = None
        self._raw_left = 0
        self._release(self._message_bytes)
        self._message_bytes = 0
        if self.transport is not None and not self.closed:
            if self.task is None:
                self.transport.write(error_bytes(status, message, headers))
            self.transport.close()

    async def _answer(self, request: Request, keep_alive: bool, http11: bool,
                      size: int) -> None:
        try:
            while True:
                self._head_sent = False
                try:
                    reply = await self.server.handler(request)
                    keep_alive = keep_alive and not self.server.stopping
                    if isinstance(reply, Reply):
                        head = frame_head(reply.status, reply.content_type, reply.headers,
                                     b"content-length: %d\r\n" % len(reply.body), keep_alive)
                        self._write(head if request.method == "HEAD" else head + reply.body)
                    else:
                        keep_alive = keep_alive and http11
                        await self._stream(reply, keep_alive, chunked=http11)
                except asyncio.CancelledError:
                    self.hang_up()  # the client left, or a shutdown deadline passed
                    raise
                except Exception as exc:
                    # The exception itself, not sys.exc_info(): compiled (mypyc) coroutines
                    # do not keep the one being handled per task.
                    log.error("handler failed for %s %s", request.method, request.path,
                              exc_info=exc)
                    if not self._head_sent:
                        self._write(error_bytes(500, "internal server error"))
                    keep_alive = False  # a broken stream ends with the connection
                finally:
                    self._release(size)
                if not keep_alive or self.closed or self.server.stopping:
                    self.hang_up()
                    return
                if not self.pending:
                    self._arm(self.server.request_timeout_s if self._reading
                              else self.server.idle_timeout_s)
                    return
                request, keep_alive, http11, size = self.pending.popleft()
                if not self.pending and self.transport is not None:
                    self.transport.resume_reading()
        finally:
            self.server.tasks.discard(cast("asyncio.Task[None]", asyncio.current_task()))
            self.task = None

    async def _stream(self, reply: Stream, keep_alive: bool, *, chunked: bool) -> None:
        chunks = reply.chunks
        pusher: Pusher | None = None
        # The body is closed after the block, not in a finally: compiled (mypyc), an await
        # while an exception is handled leaks that exception to the other tasks.
        failed: BaseException | None = None
        try:
            head = frame_head(reply.status, reply.content_type, reply.headers,
                         b"transfer-encoding: chunked\r\n" if chunked else b"", keep_alive)
            async for chunk in chunks:
                if chunk:
                    # The head leaves with the first piece: one write, one wake-up of
                    # the client, for the first token.
                    self._write(head + (frame_chunk(chunk) if chunked else chunk))
                    head = b""
                    self._head_sent = True
                    if pusher is None and reply.on_push is not None:
                        pusher = Pusher(self, chunked=chunked)
                        reply.on_push(pusher)
                    if self._write_paused:
                        await self._drain()
                if self.closed:
                    break
            else:
                self._write(head + CHUNKED_END if chunked else head)
        except BaseException as exc:
            failed = exc
        if pusher is not None:
            pusher.open = False
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        if failed is not None:
            raise failed

    def _write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def write_piece(self, data: bytes, *, chunked: bool) -> None:
        """One piece of a streamed body (`Pusher.write`)."""
        self._write(frame_chunk(data) if chunked else data)

    async def _drain(self) -> None:
        """Wait until the client's socket buffer is below its low-water mark (or it left)."""
        while self._write_paused and not self.closed:
            self._drained = self.loop.create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    def hang_up(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def close_if_idle(self) -> None:
        """Hang up unless an answer is in flight (shutdown)."""
        if self.task is None:
            self.hang_up()
