"""One keep-alive HTTP/1.1 connection and the `Exchange` it reports an answer to.

`Connection` is an `asyncio.Protocol` carrying one request at a time: httptools
calls back per header and body piece, and the connection hands every event to
the `Exchange` in flight (a `Response` for awaiting code, or the load
generator's own stamping exchange). It knows its `Pool` only to go back to it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import httptools

from dynamo_ftctl.http1.errors import ConnectError, ConnectionBroken, HttpError, ProtocolError

if TYPE_CHECKING:
    from dynamo_ftctl.http1.pool import Key, Pool

__all__ = ["Connection", "Exchange"]


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
        self.abort()

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

    def abort(self) -> None:
        """Hang up now: nothing flushed, and over TLS no close_notify exchange that would
        keep the socket open after its event loop ends (a leak asyncio warns about)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
