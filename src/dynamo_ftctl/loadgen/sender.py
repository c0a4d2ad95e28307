"""The load generator's sender: requests through `dynamo_ftctl.http1`, stamped as they come.

No client of its own: the connections, their pool, TLS and the parser are
`dynamo_ftctl.http1`'s (the proxy's upstream client too); this module is the
`Exchange` that stamps an answer's events. One keep-alive connection carries one
request at a time; a request is its head (cached per URL) plus its headers, `Content-Length`
and body, written in one call. httptools (the C parser uvicorn uses) calls back
per header and body piece into this module's `_Exchange`; the time of each read
is taken once, before any parsing, and is the stamp of every token in that
read, so no await hop sits between the bytes and their time. SSE bodies are
split on bytes (`client.SseStream`).

Against aiohttp it sends more requests per core and stamps TTFT closer to the
server's own (docs/benchmarks.md: load.py, http_clients.py). Error classes: `connect` (refused,
reset or closed before the response began), `timeout` (the whole exchange,
connect included, past `timeout_s`), `broken_stream` (cut after the headers,
or unparseable after them), `4xx_*`/`5xx_*`, `other` (a 2xx body that is not
an answer, a response that is not HTTP).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dynamo_ftctl.http1 import ConnectError, Connection, Exchange, HttpError, Pool, ProtocolError
from dynamo_ftctl.loadgen.client import SseStream, make_record, migrated_hops, parse_body
from dynamo_ftctl.loadgen.record import RequestRecord, http_error_class, retry_after_s
from dynamo_ftctl.loadgen.workload import RequestSpec

__all__ = ["Http1Sender"]


class _Exchange(Exchange):
    """One request on one connection: what came back, stamped as it arrived."""

    __slots__ = ("body", "content_type", "done", "error", "future", "migrated", "now",
                 "outcome", "retry_after", "sse", "stamp", "stamps")

    def __init__(self, future: asyncio.Future[None], now: Callable[[], float]) -> None:
        super().__init__()
        self.future = future
        self.now = now
        self.stamp = 0.0
        self.stamps: list[float] = []
        self.body: list[bytes] = []
        self.content_type = b""
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

    # -- what the connection reports
    def on_read(self) -> None:
        self.stamp = self.now()  # before parsing: the time of every token in this read

    def on_header(self, name: bytes, value: bytes) -> None:
        if name == b"content-type":
            self.content_type = value
        elif name == b"x-ftctl-migrated":
            self.migrated = value
        elif name == b"retry-after":
            self.retry_after = value

    def on_headers(self) -> None:
        if (self.status or 0) < 400 and b"text/event-stream" in self.content_type:
            self.sse = SseStream(self.stamps)

    def on_body(self, data: bytes) -> None:
        # Once per chunk, so once per token of a stream: only collect here.
        self.body.append(data)

    def on_read_end(self) -> None:
        if self.sse is not None and self.body:
            self._flush()  # the SSE pieces of this read, split in one go

    def on_complete(self) -> None:
        if self.sse is not None and self.body:
            self._flush()
        if self.future.done():
            return
        if self.sse is None and self.status is not None and self.status < 400:
            self.stamps.append(self.stamp)
        self.finish()

    def on_failure(self, error: HttpError) -> None:
        if isinstance(error, ConnectError):
            outcome = "connect"
        elif isinstance(error, ProtocolError) and not self.got_headers:
            outcome = "other"
        else:
            outcome = "broken_stream"
        self.finish(outcome, str(error))

    def _flush(self) -> None:
        """Feed the collected SSE pieces to the stream (stamped with this read's time)."""
        sse = self.sse
        assert sse is not None
        chunk = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        if sse.feed(chunk, self.stamp):
            self.finish()  # [DONE] or an error event; the rest of the body is only read

    def abandon(self, conn: Connection, outcome: str, error: str) -> None:
        """Give up (timeout, cancel): settle the exchange and hang up if still in flight."""
        self.stamp = self.now()
        self.finish(outcome, error)
        if conn.exchange is self:
            conn.abandon()


class Http1Sender:
    """Sends `RequestSpec`s over pooled keep-alive HTTP/1.1 connections; `RequestRecord`s back.

    http:// and https:// through `dynamo_ftctl.http1.Pool`: connections are
    opened as requests need them (no cap: an open loop must not queue in the
    client) and kept while the server keeps them alive. `close()` hangs up on all.
    """

    def __init__(self, *, timeout_s: float, now: Callable[[], float]) -> None:
        self.now = now
        self._timeout_s = timeout_s
        self._pool = Pool(user_agent="ftctl-load")

    async def exchange(self, method: str, url: str, body: bytes, headers: dict[str, str], *,
                       timeout_s: float | None = None) -> _Exchange:
        """Send one request; the settled exchange (its outcome says how it went)."""
        key, request = self._pool.encode(method, url, body, headers)
        loop = asyncio.get_running_loop()
        ex = _Exchange(loop.create_future(), self.now)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout_s
        conn = self._pool.take_idle(key)
        try:
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._pool.open(key, None)
        except TimeoutError:
            ex.stamp = self.now()
            ex.finish("timeout", f"no connection within {timeout_s:g} s")
            return ex
        except OSError as exc:  # ConnectError: refused, unreachable
            ex.stamp = self.now()
            ex.finish("connect", str(exc))
            return ex
        conn.start(ex, request)
        timer = loop.call_at(deadline, ex.abandon, conn, "timeout",
                             f"no full answer within {timeout_s:g} s")
        try:
            await ex.future
        except asyncio.CancelledError:
            ex.abandon(conn, "other", "cancelled")
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
        self._pool.close()
