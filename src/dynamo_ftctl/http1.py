"""A lean HTTP/1.1 client: asyncio protocols, httptools' C parser, keep-alive pools.

The proxy's upstream requests (`migrate.proxy`) and the load generator
(`loadgen.http1`) both go through it: about 3x aiohttp's requests per core on
this machine (benchmarks/http_clients.py, benchmarks/proxy.py).

- `Connection`: one keep-alive connection (an `asyncio.Protocol`) carrying one
  request at a time; httptools calls back per header and body piece, and the
  connection hands every event to the `Exchange` in flight.
- `Pool`: idle connections per (host, port), request heads cached per URL.
  A connection goes back to the pool only when its answer was read to the
  end; one closed, broken or abandoned half-way never does.
- `Response` (an `Exchange`): a streamed answer for `await`ing code: its body
  chunk by chunk (`next_chunk`, with a stall timeout and backpressure: the
  socket stops being read while 256 KiB wait unread) or whole (`read`, with a
  size limit). `close()` before the end hangs up (the way to cancel). A `sink`
  may take body pieces in the socket's callback instead, while none wait
  unread (the proxy's fast lane: no task wakes per piece).
- `Client`: `Pool` for http://, aiohttp (imported on first use) for https://.

Errors, all `HttpError` (an `OSError`, as connection errors are) or the
built-in `TimeoutError`::

    HttpError
    ├── ConnectError      refused, unreachable, or closed before any byte of an answer
    │   └── Unreachable   no connection was made: the request was never sent
    ├── ConnectionBroken  closed or reset after the answer began
    ├── ProtocolError     not HTTP, or a body framing httptools refuses
    └── BodyTooLarge      `read(limit=...)` saw more than `limit` bytes
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast
from urllib.parse import urlsplit

import httptools

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "BodyTooLarge",
    "Client",
    "ConnectError",
    "Connection",
    "ConnectionBroken",
    "Exchange",
    "HttpError",
    "Pool",
    "ProtocolError",
    "Response",
    "Unreachable",
]

Key = tuple[str, int]

# Unread body bytes of a `Response` above which its socket stops being read.
_HIGH_WATER = 256 * 1024
# `read()`'s default size limit: a JSON answer or a /metrics page is far smaller.
DEFAULT_LIMIT = 10 * 1024 * 1024


class HttpError(OSError):
    """The exchange failed below HTTP's status codes."""


class ConnectError(HttpError):
    """No answer began: refused, unreachable, or closed before its first byte."""


class Unreachable(ConnectError):
    """No connection was made (refused, unreachable): the server never saw the request."""


class ConnectionBroken(HttpError):
    """The connection closed or reset after the answer began."""


class ProtocolError(HttpError):
    """What came back is not HTTP/1.1 (or its body framing is broken)."""


class BodyTooLarge(HttpError):
    """A body read whole was larger than its limit."""


class Exchange:
    """One request on one connection: the events of its answer (subclasses keep what they need).

    The connection sets `status`, `got_headers` and `framed` (a length or chunked
    body; else the body runs until the server closes) before the callbacks that
    follow them.
    """

    __slots__ = ("framed", "got_headers", "status")

    def __init__(self) -> None:
        self.status: int | None = None
        self.got_headers = False
        self.framed = False

    def on_read(self) -> None:
        """Bytes arrived (called before they are parsed; and when the connection is lost)."""

    def on_header(self, name: bytes, value: bytes) -> None:
        """One response header (`name` lower-cased)."""

    def on_headers(self) -> None:
        """The status line and headers are complete."""

    def on_body(self, data: bytes) -> None:
        """A piece of the body, de-chunked."""

    def on_read_end(self) -> None:
        """The read that `on_read` announced is parsed."""

    def on_complete(self) -> None:
        """The answer ended (the connection is back in the pool or closed)."""

    def on_failure(self, error: HttpError) -> None:
        """The answer cannot end (the connection is closed)."""


class Connection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection driving httptools' response parser."""

    def __init__(self, pool: Pool, key: Key) -> None:
        self.pool = pool
        self.key = key
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.paused = False

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        ex.on_read()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.exchange = None
            self.close()
            ex.on_failure(ProtocolError(f"{type(exc).__name__}: {exc}"))
            return
        ex.on_read_end()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        ex = self.exchange
        if ex is None:
            return
        self.exchange = None
        ex.on_read()
        if ex.got_headers and not ex.framed:
            ex.on_complete()  # a body read until the server closed
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "server closed the connection"
        ex.on_failure(ConnectionBroken(reason) if ex.got_headers else ConnectError(reason))

    def pause_writing(self) -> None:  # a request body larger than the socket buffer
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        lower = name.lower()
        if lower in (b"content-length", b"transfer-encoding"):
            ex.framed = True
        ex.on_header(lower, value)

    def on_headers_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        ex.status = self.parser.get_status_code()
        ex.got_headers = True
        ex.on_headers()

    def on_body(self, body: bytes) -> None:
        self.exchange.on_body(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        self.exchange = None
        if self.parser.should_keep_alive() and not self.closed:
            self.resume()
            self.pool.release(self)
        else:
            self.close()
        ex.on_complete()

    # -- used by exchanges and the pool
    def start(self, ex: Exchange, request: bytes) -> None:
        """Send `request` and report its answer to `ex`."""
        assert self.transport is not None
        self.exchange = ex
        self.transport.write(request)

    def abandon(self) -> None:
        """Give up on the answer in flight: hang up (the connection leaves the pool)."""
        self.exchange = None
        self.close()

    def pause(self) -> None:
        """Stop reading the socket (the reader is behind)."""
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read the socket again."""
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def close(self) -> None:
        """Close the connection; it leaves the pool."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections per (host, port) for plain http:// URLs.

    Connections are opened as requests need them (no cap) and kept while the
    server keeps them alive. `close()` hangs up on all.
    """

    def __init__(self, *, user_agent: str = "ftctl") -> None:
        self._user_agent = user_agent
        self._idle: dict[Key, list[Connection]] = {}
        self._all: set[Connection] = set()
        self._heads: dict[tuple[str, str], tuple[Key, bytes]] = {}
        self._extras: dict[tuple[tuple[str, str], ...], bytes] = {}

    def head(self, method: str, url: str) -> tuple[Key, bytes]:
        """(host, port) and the request line, Host, User-Agent and Accept, cached per URL."""
        cache_key = (method, url)
        hit = self._heads.get(cache_key)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            msg = f"the http1 client speaks plain http only, not {url!r}"
            raise ValueError(msg)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = parts.netloc.rpartition("@")[2]  # user info is no part of a Host header
        head = (f"{method} {path} HTTP/1.1\r\nHost: {authority}\r\n"
                f"User-Agent: {self._user_agent}\r\nAccept: */*\r\n").encode("latin-1")
        entry = ((parts.hostname, parts.port or 80), head)
        if len(self._heads) < 4096:  # URLs come from a short list (workers, targets)
            self._heads[cache_key] = entry
        return entry

    def encode(self, method: str, url: str, body: bytes,
               headers: dict[str, str] | None) -> tuple[Key, bytes]:
        """(host, port) and the whole request in bytes, written in one call."""
        key, head = self.head(method, url)
        extra = b""
        if headers:
            items = tuple(headers.items())
            extra = self._extras.get(items, b"")
            if not extra:
                extra = "".join(f"{k}: {v}\r\n" for k, v in items).encode("latin-1")
                if len(self._extras) < 256:  # the same few header sets, request after request
                    self._extras[items] = extra
        return key, b"%s%sContent-Length: %d\r\n\r\n%s" % (head, extra, len(body), body)

    def take_idle(self, key: Key) -> Connection | None:
        """An idle connection to `key`, or None."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def open(self, key: Key, timeout_s: float | None) -> Connection:
        """A new connection to `key` within `timeout_s`.

        Raises `Unreachable` (refused, unreachable) or `TimeoutError`.
        """
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _transport, conn = await loop.create_connection(
                    lambda: Connection(self, key), key[0], key[1])
        except TimeoutError:
            msg = f"no connection to {key[0]}:{key[1]} within {timeout_s:g} s"
            raise TimeoutError(msg) from None
        except OSError as exc:
            msg = f"{type(exc).__name__}: {exc}"
            raise Unreachable(msg) from exc
        self._all.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Put a connection whose answer ended back in the pool."""
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: Connection) -> None:
        """A connection closed: drop it everywhere."""
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def request(self, method: str, url: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, *,
                      connect_timeout_s: float | None = None,
                      head_timeout_s: float | None = None) -> Response:
        """Send one request; its `Response` once the status line and headers are in.

        `head_timeout_s` bounds the wait for the headers once the request is sent.
        Close the response (or use it as an async context manager).
        """
        key, request = self.encode(method, url, body, headers)
        idle = self.take_idle(key)
        if idle is not None:
            try:
                return await self._send(idle, request, head_timeout_s)
            except ConnectError:
                # Closed before any byte of an answer on a kept-alive connection: the
                # server timed it out as we reused it (the keep-alive race). Once more on a
                # new connection; a worker that is really gone then refuses it.
                pass
        return await self._send(await self.open(key, connect_timeout_s), request, head_timeout_s)

    @staticmethod
    async def _send(conn: Connection, request: bytes, head_timeout_s: float | None) -> Response:
        response = Response(conn)
        conn.start(response, request)
        response.sent_at = time.monotonic()
        try:
            await response.wait_headers(head_timeout_s)
        except BaseException:
            response.close()
            raise
        return response

    def close(self) -> None:
        """Hang up on every connection."""
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()


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
        return await _read_whole(self, limit, timeout_s)

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


class _Readable(Protocol):
    async def next_chunk(self, timeout_s: float | None = None) -> bytes: ...

    def close(self) -> None: ...


async def _read_whole(response: _Readable, limit: int, timeout_s: float | None) -> bytes:
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


class _AiohttpResponse:
    """An aiohttp answer behind `Response`'s reading methods (https upstreams)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.complete = False
        self.body_wait_s: float | None = None  # not measured through aiohttp

    def header(self, name: str) -> str | None:
        return self._response.headers.get(name)

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        import aiohttp

        try:
            async with asyncio.timeout(timeout_s):
                data = await self._response.content.readany()
        except aiohttp.ClientError as exc:
            raise ConnectionBroken(f"{type(exc).__name__}: {exc}") from exc
        if not data:
            self.complete = True
        return data

    async def read(self, limit: int = DEFAULT_LIMIT, timeout_s: float | None = None) -> bytes:
        return await _read_whole(self, limit, timeout_s)

    async def wait_complete(self, timeout_s: float) -> bool:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await self._response.read()
                self.complete = True
        return self.complete

    def close(self) -> None:
        if self.complete:
            self._response.release()
        else:
            self._response.close()

    async def __aenter__(self) -> _AiohttpResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


AnyResponse = Response | _AiohttpResponse


class Client:
    """Requests to http:// URLs through a `Pool`, to https:// ones through aiohttp.

    aiohttp is imported, and its session opened, only when an https URL comes;
    its errors reach the caller as `HttpError` or `TimeoutError` like the pool's.
    """

    def __init__(self, *, user_agent: str = "ftctl") -> None:
        self.pool = Pool(user_agent=user_agent)
        self._session: aiohttp.ClientSession | None = None

    async def request(self, method: str, url: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, *,
                      connect_timeout_s: float | None = None,
                      head_timeout_s: float | None = None) -> AnyResponse:
        """Send one request; its response once the headers are in (see `Pool.request`)."""
        if url.startswith("http://"):
            return await self.pool.request(method, url, body, headers,
                                           connect_timeout_s=connect_timeout_s,
                                           head_timeout_s=head_timeout_s)
        return await self._tls_request(method, url, body, headers,
                                       connect_timeout_s=connect_timeout_s,
                                       head_timeout_s=head_timeout_s)

    async def _tls_request(self, method: str, url: str, body: bytes,
                           headers: dict[str, str] | None, *,
                           connect_timeout_s: float | None,
                           head_timeout_s: float | None) -> _AiohttpResponse:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                        sock_read=head_timeout_s)
        try:
            response = await self._session.request(method, url, data=body, headers=headers,
                                                   timeout=timeout)
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(str(exc)) from exc
        except aiohttp.ClientError as exc:
            raise ConnectionBroken(f"{type(exc).__name__}: {exc}") from exc
        return _AiohttpResponse(response)

    async def fetch(self, method: str, url: str, body: bytes = b"",
                    headers: dict[str, str] | None = None, *, timeout_s: float,
                    limit: int = DEFAULT_LIMIT) -> tuple[int, bytes]:
        """One whole exchange within `timeout_s`: (status, body)."""
        async with asyncio.timeout(timeout_s):
            response = await self.request(method, url, body, headers)
            async with response:
                return cast("int", response.status), await response.read(limit)

    async def close(self) -> None:
        """Hang up on every connection."""
        self.pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
