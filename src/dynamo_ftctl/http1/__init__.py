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
- `client`: `Client`, a `Pool` behind `request` and `fetch`; `fetch_blocking`,
  one exchange for blocking code on a private event loop.
- `errors`: the tree below.

Errors, all `HttpError` (an `OSError`, as connection errors are) or the
built-in `TimeoutError`::

    HttpError
    ├── ConnectError      refused, unreachable, or closed before any byte of an answer
    │   └── NoConnection  no connection was made (TLS refused too): the request was never sent
    ├── ConnectionBroken  closed or reset after the answer began
    ├── ProtocolError     not HTTP, or a body framing httptools refuses
    └── BodyTooLarge      `read(limit=...)` saw more than `limit` bytes
"""

from __future__ import annotations

from dynamo_ftctl.http1.client import AnyResponse, Client, fetch_blocking
from dynamo_ftctl.http1.connection import Connection, Exchange
from dynamo_ftctl.http1.errors import (
    BodyTooLarge,
    ConnectError,
    ConnectionBroken,
    HttpError,
    NoConnection,
    ProtocolError,
)
from dynamo_ftctl.http1.pool import Key, Pool
from dynamo_ftctl.http1.response import DEFAULT_LIMIT, Response, Sink

__all__ = [
    "DEFAULT_LIMIT",
    "AnyResponse",
    "BodyTooLarge",
    "Client",
    "ConnectError",
    "Connection",
    "ConnectionBroken",
    "Exchange",
    "HttpError",
    "Key",
    "NoConnection",
    "Pool",
    "ProtocolError",
    "Response",
    "Sink",
    "fetch_blocking",
]
