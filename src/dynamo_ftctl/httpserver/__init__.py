"""A lean HTTP/1.1 server: asyncio protocols, httptools' C parser, no ASGI messages.

The migrating proxy's front door (`proxy.serve.serve`): a request goes
parse -> handler -> `transport.write`, with no ASGI scope, receive/send messages
or write per message between (what that cycle costs: docs/benchmarks.md,
http_stack.py). The server side of `dynamo_ftctl.http1`.

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

Modules: `_messages` (Request, Reply, Stream, Pusher and their bytes), `_connection`
(the protocol of one client connection: parsing, caps, timeouts, writing), `_listener`
(the listening sockets of every server in the package: a stop leaves no accepted
connection open); this package's face holds the server, its defaults and `start_server`.
"""

from __future__ import annotations

import asyncio
import contextlib

from dynamo_ftctl.httpserver._connection import Connection
from dynamo_ftctl.httpserver._listener import Listener, listen_streams
from dynamo_ftctl.httpserver._messages import Handler, Pusher, Reply, Request, Stream

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_BODY", "DEFAULT_MAX_BUFFERED",
    "DEFAULT_REQUEST_TIMEOUT_S", "Handler", "Listener", "Pusher", "Reply", "Request", "Server",
    "Stream", "default_max_connections", "listen_streams",
    "raise_open_file_limit", "start_server",
]

# A generation request is a few KiB (a long prompt as token ids: ~1 MiB); more is abuse.
DEFAULT_MAX_BODY = 16 * 1024 * 1024
# Request bytes held for requests not yet answered, all connections together: sixteen
# bodies at the bound above, thousands of real ones. Without it 30 clients each holding
# 14 MiB of an unfinished body take the proxy from 140 to 540 MB.
DEFAULT_MAX_BUFFERED = 256 * 1024 * 1024
# Client connections at most, however many descriptors the process may open (nginx's
# worker_connections default is 512, HAProxy derives its maxconn from the fd limit).
_MAX_CONNECTIONS_CEILING = 4096
# Descriptors kept for all but client connections (a quarter of a small limit): listening
# sockets, the upstream pools' idle connections, files, the event loop's own.
_FD_RESERVE = 128
# Connections over the cap being answered 503 (each holds a descriptor until its client
# has read the answer, at most a second): a quarter of the cap (at least 16), at most this
# many; more are closed unanswered.
_MAX_REFUSING = 256
# Between requests on a kept-alive connection (nginx keeps 75 s, uvicorn 5 s: clients'
# pools reuse a connection within seconds, and a close under a reuse costs them a retry).
DEFAULT_IDLE_TIMEOUT_S = 60.0
# From a request's first byte to its last (nginx: 60 s for the head, 60 s between body reads).
DEFAULT_REQUEST_TIMEOUT_S = 30.0
# A backlog as uvicorn's: a burst of connects (a load test's opening, a proxy's pool
# refilling) waits in the kernel instead of retrying SYNs after 1 s.
_BACKLOG = 2048


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
        self.connections: set[Connection] = set()
        self.refusing: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self._listener: Listener | None = None
        self._address = ""

    def hold(self, size: int) -> bool:
        """Count `size` more bytes a handler keeps for a request (what it parsed the body
        into) against `max_buffered`, the one budget; False (nothing counted) when they do
        not fit. The handler gives them back with `release` when the request ends."""
        if self.buffered + size > self.max_buffered:
            return False
        self.buffered += size
        return True

    def release(self, size: int) -> None:
        """Give back bytes counted by `hold`."""
        self.buffered -= size

    async def listen(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        """Bind and listen on `host:port` (port 0: a free one, see `address`).

        `reuse_port`: SO_REUSEPORT, so that several processes listen on one port and the
        kernel spreads new connections over them (`ftctl proxy --procs N`).
        """
        self._listener = await Listener(lambda: Connection(self)).listen(
            host, port, reuse_port=reuse_port, backlog=_BACKLOG)
        host, port = self._listener.sockets[0].getsockname()[:2]
        self._address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def address(self) -> str:
        """The bound address as a URL, IPv6 hosts in brackets."""
        assert self._address, "not listening"
        return self._address

    async def shutdown(self, deadline_s: float) -> None:
        """Stop accepting, finish answers in flight within `deadline_s`, cancel the rest."""
        self.stopping = True
        if self._listener is not None:
            self._listener.close()
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
        if self._listener is not None:
            await self._listener.wait_closed(1.0)


async def start_server(handler: Handler, host: str, port: int, *,
                       max_body: int = DEFAULT_MAX_BODY,
                       idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                       request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                       max_connections: int | None = None,
                       max_buffered: int = DEFAULT_MAX_BUFFERED,
                       reuse_port: bool = False) -> Server:
    """A `Server` listening on `host:port` (an IPv6 host without brackets); `reuse_port`
    as in `Server.listen`."""
    server = Server(handler, max_body=max_body, idle_timeout_s=idle_timeout_s,
                    request_timeout_s=request_timeout_s, max_connections=max_connections,
                    max_buffered=max_buffered)
    await server.listen(host, port, reuse_port=reuse_port)
    return server

