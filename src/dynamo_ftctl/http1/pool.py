"""Keep-alive connections per (scheme, host, port), and the request heads they carry.

A connection goes back to the pool only when its answer was read to the end;
one closed, broken or abandoned half-way never does. https:// connections are
asyncio's own TLS (the default context: certificates checked, or the context a
caller passes), the same connection and parser as plain http.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

from dynamo_ftctl.http1.connection import Connection
from dynamo_ftctl.http1.errors import ConnectError, ConnectTimeout, NoConnection
from dynamo_ftctl.http1.response import Response

__all__ = ["Key", "Pool"]

# (scheme, host, port): a TLS connection is never lent to a plain-http request.
Key = tuple[str, str, int]

_DEFAULT_PORTS = {"http": 80, "https": 443}


class Pool:
    """Keep-alive connections per (scheme, host, port) for http:// and https:// URLs.

    Connections are opened as requests need them (no cap) and kept while the
    server keeps them alive. `close()` hangs up on all. `ssl_context` checks
    https servers (None: `ssl.create_default_context()`, made on the first one).
    """

    def __init__(self, *, user_agent: str = "ftctl",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._user_agent = user_agent
        self._ssl_context = ssl_context
        self._idle: dict[Key, list[Connection]] = {}
        self._all: set[Connection] = set()
        self._heads: dict[tuple[str, str], tuple[Key, bytes]] = {}
        self._extras: dict[tuple[tuple[str, str], ...], bytes] = {}

    def head(self, method: str, url: str) -> tuple[Key, bytes]:
        """(scheme, host, port) and the request line, Host, User-Agent and Accept, cached
        per URL."""
        cache_key = (method, url)
        hit = self._heads.get(cache_key)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        default_port = _DEFAULT_PORTS.get(parts.scheme)
        if default_port is None or not parts.hostname:
            msg = f"the http1 client speaks http and https only, not {url!r}"
            raise ValueError(msg)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = parts.netloc.rpartition("@")[2]  # user info is no part of a Host header
        head = (f"{method} {path} HTTP/1.1\r\nHost: {authority}\r\n"
                f"User-Agent: {self._user_agent}\r\nAccept: */*\r\n").encode("latin-1")
        entry = ((parts.scheme, parts.hostname, parts.port or default_port), head)
        if len(self._heads) < 4096:  # URLs come from a short list (workers, targets)
            self._heads[cache_key] = entry
        return entry

    def encode(self, method: str, url: str, body: bytes,
               headers: dict[str, str] | None) -> tuple[Key, bytes]:
        """(scheme, host, port) and the whole request in bytes, written in one call."""
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
        """A new connection to `key` within `timeout_s` (TLS for https).

        Raises `NoConnection` (refused, unreachable), or its `ConnectTimeout` past
        `timeout_s` (a `TimeoutError` too).
        """
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            tls = self._ssl_context
        try:
            async with asyncio.timeout(timeout_s):
                _transport, conn = await loop.create_connection(
                    lambda: Connection(self, key), host, port, ssl=tls,
                    server_hostname=host if tls is not None else None)
        except TimeoutError:
            msg = f"no connection to {host}:{port} within {timeout_s:g} s"
            raise ConnectTimeout(msg) from None
        except OSError as exc:  # ssl.SSLError too: a TLS handshake refused
            msg = f"{type(exc).__name__}: {exc}"
            raise NoConnection(msg) from exc
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
            conn.abort()
        self._all.clear()
        self._idle.clear()


