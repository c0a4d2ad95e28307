"""The one HTTP seam: a `Request` in, one `Reply` out, blocking or awaited.

Every caller that makes whole exchanges (the etcd lock, the fault injectors,
capability probes, canary probes, health waits) takes a transport rather than a
client: `Transport.handle_request` for blocking code, `AsyncTransport.handle_async_request`
for awaiting code. The real ones are `http1.BlockingClient` and `http1.Client`;
tests pass `MockTransport(handler)`, as httpx's tests do. A failure below HTTP's
status codes raises an `OSError` (http1's `HttpError` tree, or `TimeoutError`);
a status of any value is a `Reply`. A caller that reads an answer as it comes (a
stream of tokens) takes a `StreamingTransport`: `open_stream` gives a
`ReplyStream` once the headers are in (`http1.Response` is one).

This module imports neither asyncio nor ssl: the one-shot canary probe loads it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

__all__ = ["DEFAULT_LIMIT", "AsyncTransport", "MockTransport", "Reply", "ReplyStream", "Request",
           "StreamingTransport", "Transport"]

# A body read whole stops here unless the request says otherwise: a JSON answer or a
# /metrics page is far smaller.
DEFAULT_LIMIT = 10 * 1024 * 1024


class Request(msgspec.Struct, frozen=True):
    """One whole exchange to make: within `timeout_s`, its answer's body at most `limit` bytes.

    With `connect_timeout_s`, a streamed exchange (`StreamingTransport.open_stream`) has its
    connection within that and its answer's headers within `timeout_s` of the request
    going out, each bound on its own (a dead worker is told from a slow one).
    """

    method: str
    url: str
    body: bytes = b""
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    timeout_s: float = 10.0
    limit: int = DEFAULT_LIMIT
    connect_timeout_s: float | None = None

    def json(self) -> Any:
        """The body parsed as JSON (`ValueError` when it is not)."""
        from dynamo_ftctl.jsoncodec import loads

        return loads(self.body)


class Reply(msgspec.Struct, frozen=True):
    """A complete answer. `headers` has lower-case names; `first_byte_s`: seconds from the
    call to the first body byte (a stream's first event), None when the transport does not
    time it."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    first_byte_s: float | None = None

    def header(self, name: str) -> str | None:
        """A header's value (`name` in any case), or None."""
        return self.headers.get(name.lower())

    @property
    def content_type(self) -> str:
        """The Content-Type header, "" when there is none."""
        return self.headers.get("content-type", "")

    @property
    def text(self) -> str:
        """The body as UTF-8 text (U+FFFD for each bad sequence)."""
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON (`ValueError` when it is not)."""
        from dynamo_ftctl.jsoncodec import loads

        return loads(self.body)


class Transport(Protocol):
    """Blocking exchanges: `http1.BlockingClient`, or a `MockTransport` in tests."""

    def handle_request(self, request: Request) -> Reply:
        """The answer to `request`; `OSError` (`HttpError`, `TimeoutError`) when none came."""
        ...


class AsyncTransport(Protocol):
    """Awaited exchanges: `http1.Client`, or a `MockTransport` in tests."""

    async def handle_async_request(self, request: Request) -> Reply:
        """The answer to `request`; `OSError` (`HttpError`, `TimeoutError`) when none came."""
        ...


class ReplyStream(Protocol):
    """An answer whose headers are in and whose body comes piece by piece."""

    @property
    def status(self) -> int | None:
        """The status code (set once the headers are in)."""
        ...

    def header(self, name: str) -> str | None:
        """A header's value (`name` in lower case), or None."""
        ...

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        """The body bytes read since the last call (b"" at the end); `TimeoutError` after
        `timeout_s` without any, `HttpError` when the connection broke."""
        ...

    @property
    def complete(self) -> bool:
        """Whether the body has been read to its end."""
        ...

    @property
    def body_wait_s(self) -> float | None:
        """Seconds from the request going out to the first body byte (None: not yet, or
        not timed by this transport)."""
        ...

    async def wait_complete(self, timeout_s: float) -> bool:
        """Read the rest of the body (dropped) for at most `timeout_s`; whether it ended."""
        ...

    def close(self) -> None:
        """Done with the answer (before its end: hang up)."""
        ...


class StreamingTransport(Protocol):
    """Awaited exchanges read as they come: `http1.Client`, or a `MockTransport`."""

    async def open_stream(self, request: Request) -> ReplyStream:
        """The answer to `request` once its headers are in (within `request.timeout_s`)."""
        ...


class _Chunks:
    """A `ReplyStream` over a whole `Reply`: its body in the pieces given (the mock's)."""

    def __init__(self, reply: Reply, pieces: list[bytes]) -> None:
        self._reply = reply
        self._pieces = pieces

    @property
    def status(self) -> int | None:
        return self._reply.status

    def header(self, name: str) -> str | None:
        return self._reply.header(name)

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        del timeout_s
        return self._pieces.pop(0) if self._pieces else b""

    @property
    def complete(self) -> bool:
        return not self._pieces

    @property
    def body_wait_s(self) -> float | None:
        return self._reply.first_byte_s

    async def wait_complete(self, timeout_s: float) -> bool:
        del timeout_s
        self._pieces.clear()
        return True

    def close(self) -> None:
        self._pieces.clear()


Handler = Callable[[Request], "Reply | Awaitable[Reply]"]


class MockTransport:
    """Every transport over one `handler(request) -> Reply` (httpx's `MockTransport`).

    The handler answers, or raises what a real transport would (`http1.NoConnection`,
    `TimeoutError`, ...). An async handler serves only the awaited calls. `open_stream`
    hands the body out in pieces of `chunk_size` bytes (all at once by default), so a
    reader's split-read path is tested too.
    """

    def __init__(self, handler: Handler, *, chunk_size: int | None = None) -> None:
        self.handler = handler
        self.chunk_size = chunk_size

    def handle_request(self, request: Request) -> Reply:
        """The handler's reply to `request`."""
        reply = self.handler(request)
        if not isinstance(reply, Reply):
            close = getattr(reply, "close", None)  # an async handler's coroutine: never run
            if close is not None:
                close()
            msg = "MockTransport.handle_request needs a handler that returns a Reply"
            raise TypeError(msg)
        return reply

    async def handle_async_request(self, request: Request) -> Reply:
        """The handler's reply to `request`, awaited when the handler is async."""
        reply = self.handler(request)
        return reply if isinstance(reply, Reply) else await reply

    async def open_stream(self, request: Request) -> ReplyStream:
        """The handler's reply to `request`, its body read back in pieces."""
        reply = await self.handle_async_request(request)
        size = self.chunk_size or max(1, len(reply.body))
        body = reply.body
        return _Chunks(reply, [body[i:i + size] for i in range(0, len(body), size)])
