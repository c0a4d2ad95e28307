"""The daemon's fan-out transport: `ClientTransport` over one shared `http1.Client`.

An `http1.AsyncTransport` that raises `health.transport.TransportError`s;
`health.transport` holds those errors, `apost_json` and the one-shot probe's
blocking transport; this module is the async side, apart so that the one-shot
probe never imports asyncio or http1's client.

The daemon sends 30,000 requests a round for 10,000 workers (benchmarks/canary.py):
each is one `ProbeExchange` on a pooled keep-alive connection, the answer collected
whole in the connection's callbacks and settled through one future, its deadline
one timer: no task, stream reader or timeout context per request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from dynamo_ftctl.health.transport import (
    JSON_HEADERS,
    MAX_BODY_BYTES,
    TransportError,
    endless,
    too_large,
)
from dynamo_ftctl.http1 import (
    ConnectError,
    Connection,
    Exchange,
    HttpError,
    NoConnection,
    ProtocolError,
)
from dynamo_ftctl.http1.transport import Reply, Request

if TYPE_CHECKING:
    from dynamo_ftctl.http1 import Client, Key, Pool

__all__ = ["AiohttpTransport", "ClientTransport", "ProbeExchange"]


class ProbeExchange(Exchange):
    """One canary request on one connection: the answer collected whole, settled once.

    The connection's callbacks fill it and resolve `future`; no task waits per
    chunk (the daemon sends 30,000 of these a round for 10,000 workers).
    """

    __slots__ = ("body", "connection", "content_type", "first_at", "future", "max_bytes",
                 "received")

    def __init__(self, future: asyncio.Future[None], max_bytes: int,
                 connection: Connection) -> None:
        super().__init__()
        self.future = future
        self.max_bytes = max_bytes
        self.connection = connection
        self.body: list[bytes] = []
        self.received = 0
        self.content_type = b""
        self.first_at: float | None = None  # the loop's time at the first body byte

    def _settle(self, error: BaseException | None = None) -> None:
        if self.future.done():
            return
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name == b"content-type":
            self.content_type = value

    def on_body(self, data: bytes) -> None:
        if self.first_at is None:
            self.first_at = self.future.get_loop().time()
        self.received += len(data)
        if self.received <= self.max_bytes:
            self.body.append(data)

    def on_read_end(self) -> None:
        # Not in on_body: hanging up inside the parser's callback would leave it
        # calling back into a connection that has no exchange.
        if self.received > self.max_bytes and not self.future.done():
            self.give_up()
            self._settle(too_large(self.received, self.max_bytes))

    def on_complete(self) -> None:
        over = self.received > self.max_bytes
        self._settle(too_large(self.received, self.max_bytes) if over else None)

    def on_failure(self, error: HttpError) -> None:
        self._settle(error)

    def expire(self) -> None:
        """The deadline passed: settle with `TimeoutError` and hang up."""
        if not self.future.done():
            self.give_up()
            self._settle(TimeoutError())

    def give_up(self) -> None:
        """Hang up if the answer is still in flight on the connection."""
        if self.connection.exchange is self:
            self.connection.abandon()


# Request heads cached per URL (one per worker and endpoint): the pool's own cache
# stops at 4,096 URLs, and 10,000 workers would parse their URLs on every request.
_MAX_HEADS = 1 << 16


class ClientTransport:
    """One shared `dynamo_ftctl.http1.Client` (the daemon's fan-out); `close` when done.

    A POST is one `ProbeExchange` on a pooled keep-alive connection, its
    deadline one timer: no task, no stream reader, no timeout context per
    request. A kept-alive connection that closes before any byte of the answer
    (the server timed it out as it was reused) is retried once on a new one.
    The pool has no connection cap: the daemon bounds the probes in flight with
    its own semaphore, so `concurrency` only sizes nothing (kept for its callers).
    """

    def __init__(self, *, concurrency: int = 256, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.concurrency = concurrency
        self._client: Client | None = None
        self._heads: dict[str, tuple[Key, bytes]] = {}

    @property
    def session(self) -> Client:
        """The shared client (transition actions use it too)."""
        if self._client is None:
            from dynamo_ftctl.http1 import Client

            self._client = Client(user_agent="ftctl-canary")
        return self._client

    async def close(self) -> None:
        """Hang up on every connection."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _encode(self, pool: Pool, request: Request) -> tuple[Key, bytes]:
        url, body, headers = request.url, request.body, request.headers
        if request.method != "POST" or headers != JSON_HEADERS:
            return pool.encode(request.method, url, body, headers)
        hit = self._heads.get(url)
        if hit is None:
            key, head = pool.head("POST", url)
            head += b"Content-Type: application/json\r\n"
            hit = (key, head)
            if len(self._heads) < _MAX_HEADS:
                self._heads[url] = hit
        return hit[0], b"%sContent-Length: %d\r\n\r\n%s" % (hit[1], len(body), body)

    async def handle_async_request(self, request: Request) -> Reply:
        """The answer to `request` (`http1.AsyncTransport`); `TransportError` when no
        complete response came. The body stops at `request.limit` or `max_bytes`."""
        loop = asyncio.get_running_loop()
        pool = self.session.pool
        url, timeout_s = request.url, request.timeout_s
        max_bytes = min(self.max_bytes, request.limit)
        key, wire = self._encode(pool, request)
        started = loop.time()
        deadline = started + timeout_s
        conn = pool.take_idle(key)
        reused = conn is not None
        while True:
            if conn is None:
                try:
                    conn = await pool.open(key, max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise TransportError("timeout", f"no response within {timeout_s:g} s") \
                        from None
                except NoConnection as exc:  # refused, unreachable, TLS refused: never sent
                    raise _refused(url, exc) from None
            ex = ProbeExchange(loop.create_future(), max_bytes, conn)
            conn.start(ex, wire)
            timer = loop.call_at(deadline, ex.expire)
            try:
                await ex.future
            except TransportError:
                raise
            except TimeoutError:
                if ex.got_headers and ex.received:
                    raise endless(ex.received, timeout_s,
                                   ex.content_type.decode("latin-1")) from None
                what = "response body" if ex.got_headers else "response"
                raise TransportError("timeout", f"no {what} within {timeout_s:g} s") from None
            except ProtocolError as exc:
                raise TransportError("protocol", f"not an HTTP response ({exc})") from None
            except ConnectError as exc:  # closed before any byte of an answer
                if reused:  # the keep-alive race: once more on a new connection
                    reused, conn = False, None
                    continue
                raise TransportError("reset", f"connection lost before answering: {exc}") \
                    from None
            except OSError as exc:  # ConnectionBroken: closed or reset after the head
                where = "mid-body" if ex.got_headers else "before answering"
                raise TransportError("reset", f"connection lost {where}: {exc}") from None
            except BaseException:  # cancelled: the connection cannot carry the rest
                ex.give_up()
                raise
            finally:
                timer.cancel()
            assert ex.status is not None  # set once the headers are in
            data = ex.body[0] if len(ex.body) == 1 else b"".join(ex.body)
            first = None if ex.first_at is None else ex.first_at - started
            headers = {"content-type": ex.content_type.decode("latin-1")} \
                if ex.content_type else {}
            return Reply(ex.status, data, headers, first)


def _refused(url: str, exc: Exception) -> TransportError:
    authority = urlsplit(url).netloc.rpartition("@")[2]
    cause = exc.__cause__
    detail = getattr(cause, "strerror", None) or cause or exc
    return TransportError("refused", f"cannot connect to {authority}: {detail}")


# `ClientTransport` under its former name, kept for callers that import it
# (docs/history.md, "Renamed").
AiohttpTransport = ClientTransport
