"""The load generator's default client: HTTP/1.1 on asyncio protocols, parsed by httptools.

One `_Connection` (an `asyncio.Protocol`) per keep-alive connection carries
one request at a time; idle connections wait in a per-host pool. A request
is its pre-encoded head (method, path, host and headers, cached per URL)
plus `Content-Length` and the body, written in one call. httptools (the C
parser uvicorn uses) calls back per header and body piece; the time of each
read is taken once in `data_received`, before any parsing, and is the stamp
of every token in that read, so no await hop sits between the bytes and
their time. SSE bodies are split on bytes (`client.SseStream`).

Compared with aiohttp on this machine (benchmarks/http_clients.py,
benchmarks/load.py): about 3x the requests per core, and TTFT stamps closer to
the server's own. Error classes match `AiohttpSender`'s: `connect` (refused,
reset or closed before the response began), `timeout` (the whole exchange,
connect included, past `timeout_s`), `broken_stream` (cut after the headers,
or unparseable after them), `4xx_*`/`5xx_*`, `other` (a 2xx body that is not
an answer, a response that is not HTTP).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from dynamo_ftctl.loadgen.client import SseStream, make_record, migrated_hops, parse_body
from dynamo_ftctl.loadgen.record import RequestRecord, http_error_class, retry_after_s
from dynamo_ftctl.loadgen.workload import RequestSpec

__all__ = ["Http1Sender"]

_Key = tuple[str, int]


class _Exchange:
    """One request on one connection: what came back, stamped as it arrived."""

    __slots__ = ("body", "content_type", "done", "error", "framed", "future", "got_headers",
                 "migrated", "outcome", "retry_after", "sse", "stamp", "stamps", "status")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.stamp = 0.0
        self.stamps: list[float] = []
        self.body: list[bytes] = []
        self.status: int | None = None
        self.got_headers = False
        self.content_type = b""
        self.framed = False  # a length or chunked body (else: read until close)
        self.migrated: bytes | None = None
        self.retry_after: bytes | None = None
        self.sse: SseStream | None = None
        self.done = 0.0
        self.outcome = "ok"
        self.error: str | None = None

    def finish(self, outcome: str = "ok", error: str | None = None) -> None:
        """Settle the exchange (once) at the time of the last read."""
        if self.future.done():
            return
        if self.outcome == "ok":
            self.outcome, self.error = outcome, error
        self.done = self.stamp
        self.future.set_result(None)


class _Connection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection driving httptools' response parser."""

    def __init__(self, sender: Http1Sender, key: _Key) -> None:
        self._sender = sender
        self.key = key
        self._now = sender.now
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        ex.stamp = self._now()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            ex.finish("broken_stream" if ex.got_headers else "other",
                      f"{type(exc).__name__}: {exc}")
            self.close()
            return
        if ex.sse is not None and ex.body:
            self._flush(ex)  # the SSE pieces of this read, split in one go

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._sender.forget(self)
        ex = self.exchange
        if ex is None:
            return
        self.exchange = None
        ex.stamp = self._now()
        if ex.got_headers and not ex.framed and not ex.future.done():
            self._complete(ex)  # a body read until the server closed
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "server closed the connection"
        ex.finish("broken_stream" if ex.got_headers else "connect", reason)

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        lower = name.lower()
        if lower == b"content-type":
            ex.content_type = value
        elif lower in (b"content-length", b"transfer-encoding"):
            ex.framed = True
        elif lower == b"x-ftctl-migrated":
            ex.migrated = value
        elif lower == b"retry-after":
            ex.retry_after = value

    def on_headers_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        ex.status = status = self._parser.get_status_code()
        ex.got_headers = True
        if status < 400 and b"text/event-stream" in ex.content_type:
            ex.sse = SseStream(ex.stamps)

    def on_body(self, body: bytes) -> None:
        # Once per chunk, so once per token of a stream: only collect here.
        self.exchange.body.append(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        self.exchange = None
        self._complete(ex)
        if self._parser.should_keep_alive() and not self.closed:
            self._sender.release(self.key, self)
        else:
            self.close()

    # -- helpers
    @staticmethod
    def _flush(ex: _Exchange) -> None:
        """Feed the collected SSE pieces to the stream (stamped with this read's time)."""
        sse = ex.sse
        assert sse is not None
        chunk = ex.body[0] if len(ex.body) == 1 else b"".join(ex.body)
        ex.body.clear()
        if sse.feed(chunk, ex.stamp):
            ex.finish()  # [DONE] or an error event; the rest of the body is only read

    def _complete(self, ex: _Exchange) -> None:
        if ex.sse is not None and ex.body:
            self._flush(ex)
        if ex.future.done():
            return
        if ex.sse is None and ex.status is not None and ex.status < 400:
            ex.stamps.append(ex.stamp)
        ex.finish()

    def start(self, ex: _Exchange, request: bytes) -> None:
        """Send `request` and read its answer into `ex`."""
        assert self.transport is not None
        self.exchange = ex
        self.transport.write(request)

    def abandon(self, outcome: str, error: str) -> None:
        """Give up on the exchange in flight (timeout, cancel): settle it and hang up."""
        ex = self.exchange
        if ex is not None:
            ex.stamp = self._now()
            ex.finish(outcome, error)
        self.close()

    def close(self) -> None:
        """Close the connection; it leaves the pool."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Sender:
    """Sends `RequestSpec`s over pooled keep-alive HTTP/1.1 connections; `RequestRecord`s back.

    Plain http:// only (TLS targets take `AiohttpSender`). Connections are opened
    as requests need them (no cap: an open loop must not queue in the client)
    and kept while the server keeps them alive. `close()` hangs up on all.
    """

    def __init__(self, *, timeout_s: float, now: Callable[[], float]) -> None:
        self.now = now
        self._timeout_s = timeout_s
        self._idle: dict[_Key, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._heads: dict[tuple[str, str], tuple[_Key, bytes]] = {}

    def _head(self, method: str, url: str, headers: dict[str, str]) -> tuple[_Key, bytes]:
        """(host, port) and the encoded request head up to `Content-Length`, cached per URL."""
        cache_key = (method, url)
        hit = self._heads.get(cache_key)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            msg = f"the http1 client speaks plain http only, not {url!r}"
            raise ValueError(msg)
        port = parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}",
                 "User-Agent: ftctl-load", "Accept: */*"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        entry = ((parts.hostname, port), head)
        if len(self._heads) < 4096:  # URLs come from a short target list
            self._heads[cache_key] = entry
        return entry

    def release(self, key: _Key, conn: _Connection) -> None:
        """Put a connection whose answer ended back in the pool."""
        self._idle.setdefault(key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        """A connection closed: drop it everywhere."""
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _idle_connection(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _open(self, key: _Key) -> _Connection:
        loop = asyncio.get_running_loop()
        _transport, conn = await loop.create_connection(
            lambda: _Connection(self, key), key[0], key[1])
        self._all.add(conn)
        return conn

    async def exchange(self, method: str, url: str, body: bytes, headers: dict[str, str], *,
                       timeout_s: float | None = None) -> _Exchange:
        """Send one request; the settled exchange (its outcome says how it went)."""
        key, head = self._head(method, url, headers)
        loop = asyncio.get_running_loop()
        ex = _Exchange(loop.create_future())
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout_s
        conn = self._idle_connection(key)
        try:
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._open(key)
        except TimeoutError:
            ex.stamp = self.now()
            ex.finish("timeout", f"no connection within {timeout_s:g} s")
            return ex
        except OSError as exc:
            ex.stamp = self.now()
            ex.finish("connect", f"{type(exc).__name__}: {exc}")
            return ex
        conn.start(ex, b"%s%d\r\n\r\n%s" % (head, len(body), body))
        timer = loop.call_at(deadline, conn.abandon, "timeout",
                             f"no full answer within {timeout_s:g} s")
        try:
            await ex.future
        except asyncio.CancelledError:
            conn.abandon("other", "cancelled")
            raise
        finally:
            timer.cancel()
        return ex

    async def send(self, spec: RequestSpec, planned: float, *, warmup: bool,
                   t0: float) -> RequestRecord:
        """Send `spec` now; `planned` is its planned offset from `t0`, the run's start."""
        sent = self.now() - t0
        ex = await self.exchange("POST", spec.url, spec.body, spec.headers)
        outcome, error = ex.outcome, ex.error
        usage_tokens: int | None = None
        server_ttft: float | None = None
        retry_after: float | None = None
        status = ex.status
        migrated = migrated_hops(ex.migrated)
        if outcome == "ok" and status is not None:
            if status >= 400:
                outcome, error = http_error_class(status), f"HTTP {status}"
                retry_after = retry_after_s(status, ex.retry_after)
            elif ex.sse is not None:
                outcome, error, usage_tokens, server_ttft = ex.sse.end(ex.done)
                migrated = max(migrated, ex.sse.migrated)
            else:
                usage_tokens, error = parse_body(b"".join(ex.body))
                if error is not None:
                    outcome = "other"
        return make_record(spec, planned, t0=t0, sent=sent, done=ex.done, stamps=ex.stamps,
                           status=status, outcome=outcome, error=error,
                           usage_tokens=usage_tokens, server_ttft=server_ttft,
                           migrated=migrated, warmup=warmup, retry_after=retry_after)

    async def get(self, url: str, *, timeout_s: float) -> tuple[int | None, bytes]:
        """GET `url`: (status, or None when it failed; body)."""
        ex = await self.exchange("GET", url, b"", {}, timeout_s=timeout_s)
        if ex.outcome != "ok":
            return None, b""
        return ex.status, b"".join(ex.body)

    def close(self) -> None:
        """Hang up on every connection."""
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
