"""A lean HTTP/1.1 server: asyncio protocols, httptools' C parser, no ASGI messages.

The migrating proxy's front door (`migrate.proxy.serve`): a request goes
parse -> handler -> `transport.write`, where uvicorn's ASGI cycle (scope,
receive/send messages, a write per message) cost the proxy's one core ~350 us
a request start and ~40% of its CPU (py-spy, benchmarks/proxy.py). The server
side of `dynamo_ftctl.http1`.

- `Request`: method, path, query, lower-cased headers and the whole body (by
  Content-Length or chunked; more than `max_body` bytes is 413).
- Caps (a slow or hostile client must not grow the process without bound):
  at most `max_connections` clients (default: what the descriptor limit leaves
  room for, see `default_max_connections`); one more is answered 503 and closed.
  Requests not yet answered (heads and bodies, partial ones included) hold at
  most `max_buffered` bytes across all connections: the request that would go
  over is answered 503 and its bytes dropped; an answered or closed connection's
  bytes are released.
- An `Upgrade` (h2c from `curl --http2`, websocket) is ignored: the request is
  answered in HTTP/1.1 on the same connection (RFC 9110 section 7.8).
- A handler returns a `Reply` (a whole body, sent with Content-Length) or a
  `Stream` (chunked: its first piece goes out in the same write as the head).
- Keep-alive; pipelined requests are answered in order (reading pauses while
  one waits). Malformed HTTP is answered 400 and the connection closed.
  `Expect: 100-continue` is answered at once; HEAD gets the head only; an
  HTTP/1.0 client gets a `Stream` close-delimited (it has no chunked coding).
- Backpressure: a `Stream` is not pulled while the client's socket buffer is
  above its high-water mark (`pause_writing`), so a slow reader slows the
  upstream instead of filling this process's memory.
- Fast lane: once a `Stream`'s head is out, its `on_push` gets a `Pusher` that
  writes body pieces straight to the client's socket from any callback (the
  proxy writes each token from its upstream socket's callback: no task wakes
  per token). It refuses while the client's buffer is full or the answer is
  over; what it refuses comes through `chunks`, in order.
- A client that hangs up cancels its handler's task (the upstream request
  ends with it).
- Timeouts: a connection idle between requests is closed after
  `idle_timeout_s` (60 s), and a request not read whole within
  `request_timeout_s` (30 s) of its first byte is answered 408 (slow or stuck
  clients do not hold sockets forever). An answer in flight has no timeout here:
  its handler bounds it.
- `Server.shutdown(deadline_s)`: stop accepting, close idle connections, wait
  for answers in flight until the deadline, then cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast
from urllib.parse import unquote

import httptools

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_BODY", "DEFAULT_MAX_BUFFERED",
    "DEFAULT_REQUEST_TIMEOUT_S", "Handler", "Pusher", "Reply", "Request", "Server", "Stream",
    "call_asgi", "default_max_connections", "raise_open_file_limit", "start_server",
]

log = logging.getLogger("ftctl.httpserver")

# A generation request is a few KiB (a long prompt as token ids: ~1 MiB); more is abuse.
DEFAULT_MAX_BODY = 16 * 1024 * 1024
# Request bytes held for requests not yet answered, all connections together: sixteen
# bodies at the bound above, thousands of real ones. Without it 30 clients each holding
# 14 MiB of an unfinished body took the proxy from 140 to 540 MB (issue 22).
DEFAULT_MAX_BUFFERED = 256 * 1024 * 1024
# Client connections at most, however many descriptors the process may open (nginx's
# worker_connections default is 512, HAProxy derives its maxconn from the fd limit).
_MAX_CONNECTIONS_CEILING = 4096
# Descriptors kept for all but client connections (a quarter of a small limit): listening
# sockets, the upstream pools' idle connections, files, the event loop's own.
_FD_RESERVE = 128
# Connections over the cap being answered 503 (each holds a descriptor until its client
# has read the answer, at most `_REFUSE_LINGER_S`): a quarter of the cap (at least 16),
# at most this many; more are closed unanswered.
_MAX_REFUSING = 256
_REFUSE_LINGER_S = 1.0
# Between requests on a kept-alive connection (nginx keeps 75 s, uvicorn 5 s: clients'
# pools reuse a connection within seconds, and a close under a reuse costs them a retry).
DEFAULT_IDLE_TIMEOUT_S = 60.0
# From a request's first byte to its last (nginx: 60 s for the head, 60 s between body reads).
DEFAULT_REQUEST_TIMEOUT_S = 30.0
# Request line and headers together: as much as common servers allow (nginx: 4 x 8 KiB).
_MAX_HEAD = 64 * 1024
_BACKLOG = 2048
# The client socket's write buffer above which a `Stream` is no longer pulled.
_WRITE_HIGH_WATER = 64 * 1024

_STATUS_LINES: dict[int, bytes] = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus
}
_CHUNKED_END = b"0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    """`data` as one piece of a chunked body (not empty: that is the end)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _status_line(status: int) -> bytes:
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

    def __init__(self, conn: _Connection, *, chunked: bool) -> None:
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


def _head(status: int, content_type: str, headers: Mapping[str, str], framing: bytes,
          keep_alive: bool) -> bytes:
    lines = [_status_line(status), b"content-type: ", content_type.encode("latin-1"), b"\r\n"]
    lines.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
    lines.append(framing)
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _error_bytes(status: int, message: str, headers: Mapping[str, str] | None = None) -> bytes:
    body = message.encode()
    return _head(status, "text/plain; charset=utf-8", headers or {},
                 b"content-length: %d\r\n" % len(body), keep_alive=False) + body


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; the new soft limit.

    The soft limit is often 1024 for select()'s sake (systemd's default); asyncio polls
    with epoll, so a server may take what the hard limit allows (Go's runtime does so
    at start). Where the system refuses, the limit stays as it was.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(fd_limit: int | None = None) -> int:
    """Client connections that fit under `fd_limit` (default: this process's soft limit).

    Each client may also hold an upstream connection, and a quarter as many again may
    be being refused: 4/9 of what a reserve leaves; at most 4096, at least 16.
    """
    if fd_limit is None:
        import resource

        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if fd_limit == resource.RLIM_INFINITY:
            fd_limit = 1 << 20
    room = (fd_limit - min(_FD_RESERVE, fd_limit // 4)) * 4 // 9
    return max(16, min(_MAX_CONNECTIONS_CEILING, room))


class _Connection(asyncio.Protocol):
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
        self._reading = False  # a request's first byte came, its last not yet

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
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
        self.transport.write(_error_bytes(
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
        self._disarm()
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
        parts = httptools.parse_url(self._url)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            method=self.parser.get_method().decode("latin-1"),
            path=(parts.path or b"/").decode("latin-1"),
            query=(parts.query or b"").decode("latin-1"),
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
    def _arm(self, seconds: float) -> None:
        self._disarm()
        if seconds > 0 and not self.closed:
            self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
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
                self.transport.write(_error_bytes(status, message, headers))
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
                        head = _head(reply.status, reply.content_type, reply.headers,
                                     b"content-length: %d\r\n" % len(reply.body), keep_alive)
                        self._write(head if request.method == "HEAD" else head + reply.body)
                    else:
                        keep_alive = keep_alive and http11
                        await self._stream(reply, keep_alive, chunked=http11)
                except asyncio.CancelledError:
                    self.hang_up()  # the client left, or a shutdown deadline passed
                    raise
                except Exception:
                    log.exception("handler failed for %s %s", request.method, request.path)
                    if not self._head_sent:
                        self._write(_error_bytes(500, "internal server error"))
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
        try:
            head = _head(reply.status, reply.content_type, reply.headers,
                         b"transfer-encoding: chunked\r\n" if chunked else b"", keep_alive)
            async for chunk in chunks:
                if chunk:
                    # The head leaves with the first piece: one write, one wake-up of
                    # the client, for the first token.
                    self._write(head + (_chunk(chunk) if chunked else chunk))
                    head = b""
                    self._head_sent = True
                    if pusher is None and reply.on_push is not None:
                        pusher = Pusher(self, chunked=chunked)
                        reply.on_push(pusher)
                    if self._write_paused:
                        await self._drain()
                if self.closed:
                    return
            self._write(head + _CHUNKED_END if chunked else head)
        finally:
            if pusher is not None:
                pusher.open = False
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def write_piece(self, data: bytes, *, chunked: bool) -> None:
        """One piece of a streamed body (`Pusher.write`)."""
        self._write(_chunk(data) if chunked else data)

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


class Server:
    """The listening sockets, live connections and handler tasks of one server."""

    def __init__(self, handler: Handler, *, max_body: int = DEFAULT_MAX_BODY,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 max_connections: int | None = None,
                 max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        self.handler = handler
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_connections = (default_max_connections() if max_connections is None
                                else max_connections)
        self.max_refusing = min(_MAX_REFUSING, max(16, self.max_connections // 4))
        self.max_buffered = max_buffered
        self.buffered = 0  # request bytes held for requests not yet answered, all connections
        self.refused_connections = 0  # answered 503 for being over `max_connections`
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.refusing: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None

    async def listen(self, host: str, port: int) -> None:
        """Bind and listen on `host:port` (port 0: a free one, see `address`)."""
        # A backlog as uvicorn's (2048): a burst of connects (a load test's opening, a
        # proxy's pool refilling) waits in the kernel instead of retrying SYNs after 1 s.
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=_BACKLOG)

    @property
    def address(self) -> str:
        """The bound address as a URL, IPv6 hosts in brackets."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def shutdown(self, deadline_s: float) -> None:
        """Stop accepting, finish answers in flight within `deadline_s`, cancel the rest."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in [*self.connections, *self.refusing]:
            conn.close_if_idle()
        tasks = set(self.tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=deadline_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for conn in list(self.connections):
            conn.hang_up()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


async def call_asgi(app: Callable[..., Awaitable[None]], request: Request) -> Reply:
    """Answer `request` with an ASGI app (routes off the hot path); its answer is buffered.

    The app's `receive` gives the body, then waits: a client that leaves cancels
    the handler task, the app with it.
    """
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http",
        "path": unquote(request.path), "raw_path": request.path.encode("latin-1"),
        "query_string": request.query.encode("latin-1"), "root_path": "",
        "headers": request.headers, "client": request.client, "server": None, "state": {},
    }
    delivered = False

    async def receive() -> dict[str, object]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # never set: cancelled with the task
        return {"type": "http.disconnect"}  # pragma: no cover

    status = 500
    content_type = "application/octet-stream"
    headers: dict[str, str] = {}
    parts: list[bytes] = []

    async def send(message: Mapping[str, object]) -> None:
        nonlocal status, content_type
        if message["type"] == "http.response.start":
            status = cast("int", message["status"])
            for name, value in cast("Iterable[tuple[bytes, bytes]]", message.get("headers", ())):
                key = name.decode("latin-1").lower()
                if key == "content-type":
                    content_type = value.decode("latin-1")
                elif key not in ("content-length", "transfer-encoding", "connection"):
                    headers[key] = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            parts.append(cast("bytes", message.get("body", b"")))

    await app(scope, receive, send)
    return Reply(status, b"".join(parts), content_type=content_type, headers=headers)


async def start_server(handler: Handler, host: str, port: int, *,
                       max_body: int = DEFAULT_MAX_BODY,
                       idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                       request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                       max_connections: int | None = None,
                       max_buffered: int = DEFAULT_MAX_BUFFERED) -> Server:
    """A `Server` listening on `host:port` (an IPv6 host without brackets)."""
    server = Server(handler, max_body=max_body, idle_timeout_s=idle_timeout_s,
                    request_timeout_s=request_timeout_s, max_connections=max_connections,
                    max_buffered=max_buffered)
    await server.listen(host, port)
    return server

