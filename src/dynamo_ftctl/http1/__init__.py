"""A lean HTTP/1.1 client: asyncio protocols, httptools' C parser, keep-alive pools.

The package's one HTTP client for async code: the proxy's upstream requests
(`proxy.serve`), the load generator (`loadgen.sender`), capability checks.
Its requests per core against aiohttp and httpx: docs/benchmarks.md
(http_clients.py, load.py). One noun per module:

- `connection`: `Connection`, one keep-alive connection (an `asyncio.Protocol`)
  carrying one request at a time; httptools calls back per header and body
  piece, and the connection hands every event to the `Exchange` in flight.
- `pool`: `Pool`, idle connections per (scheme, host, port), request heads
  cached per URL; https over asyncio's TLS on the same connections.
- `response`: `Response` (an `Exchange`), a streamed answer for `await`ing code.
- `client`: `Client`, a `Pool` behind `request`, `fetch` and
  `handle_async_request`; `BlockingClient` beside it, one exchange for blocking
  code on a private event loop (`fetch_blocking`, its one-call form).
- `transport`: the seam. `Request` in, `Reply` out; `Transport` (blocking) and
  `AsyncTransport` (awaited), `StreamingTransport` (read as it comes);
  `MockTransport(handler)` for tests.
- `errors`: the tree below.

Errors, all `HttpError` (an `OSError`, as connection errors are) or the
built-in `TimeoutError`::

    HttpError
    ├── ConnectError      refused, unreachable, or closed before any byte of an answer
    │   └── NoConnection  no connection was made (TLS refused too): the request was never sent
    │       └── ConnectTimeout  none within the connect timeout (a `TimeoutError` too)
    ├── ConnectionBroken  closed or reset after the answer began
    ├── ProtocolError     not HTTP, or a body framing httptools refuses
    └── BodyTooLarge      `read(limit=...)` saw more than `limit` bytes

Names are loaded on first use: `transport` and `errors` import neither asyncio nor
ssl, so the one-shot canary probe can take the seam without the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.http1.errors import (
    BodyTooLarge,
    ConnectError,
    ConnectionBroken,
    ConnectTimeout,
    HttpError,
    NoConnection,
    ProtocolError,
)
from dynamo_ftctl.http1.transport import (
    DEFAULT_LIMIT,
    AsyncTransport,
    MockTransport,
    Reply,
    ReplyStream,
    Request,
    StreamingTransport,
    Transport,
)

if TYPE_CHECKING:
    from dynamo_ftctl.http1.client import BlockingClient, Client, fetch_blocking
    from dynamo_ftctl.http1.connection import Connection, Exchange
    from dynamo_ftctl.http1.pool import Key, Pool
    from dynamo_ftctl.http1.response import Response, Sink

__all__ = [
    "DEFAULT_LIMIT",
    "AsyncTransport",
    "BlockingClient",
    "BodyTooLarge",
    "Client",
    "ConnectError",
    "ConnectTimeout",
    "Connection",
    "ConnectionBroken",
    "Exchange",
    "HttpError",
    "Key",
    "MockTransport",
    "NoConnection",
    "Pool",
    "ProtocolError",
    "Reply",
    "ReplyStream",
    "Request",
    "Response",
    "Sink",
    "StreamingTransport",
    "Transport",
    "fetch_blocking",
]

# The names whose modules import asyncio, loaded when first asked for.
_LATE = {
    "BlockingClient": "client", "Client": "client",
    "fetch_blocking": "client", "Connection": "connection", "Exchange": "connection",
    "Key": "pool", "Pool": "pool", "Response": "response", "Sink": "response",
}


def __getattr__(name: str) -> Any:
    module = _LATE.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
