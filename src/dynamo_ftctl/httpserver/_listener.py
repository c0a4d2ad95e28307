"""A TCP listener whose close leaves no accepted connection behind.

`loop.create_server` accepts in a callback and makes each connection's transport a loop
turn later; on Python 3.11 a connection accepted just before `Server.close()` then fails
an assertion while its transport is made (`Server._attach`), and the accepted socket is
never closed: its client waits forever, and the socket is found open by the garbage
collector (a ResourceWarning). Every server of the package listens here instead, so
each accepted connection is accounted for: it is handed to its protocol, or, when the
listener closes first, cut with a reset. `close()` closes the listening sockets too, so
the kernel resets connections still in the accept queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable

__all__ = ["Listener", "listen_streams"]

# accept() calls per readiness callback: what asyncio's own accept loop does (its
# backlog argument), so that a burst is not accepted one loop turn per connection.
_ACCEPTS_PER_TURN = 100


def cut_socket(sock: socket.socket) -> None:
    """Close `sock` with a TCP reset (SO_LINGER 0), the way a crashed peer's kernel
    answers."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class Listener:
    """Listening sockets on `host:port` that hand each accepted connection to a protocol
    made by `factory`, until `close()`."""

    def __init__(self, factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self._factory = factory
        self._sockets: list[socket.socket] = []
        self._unstarted: set[socket.socket] = set()  # accepted, no transport yet
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening sockets (empty once closed)."""
        return tuple(self._sockets)

    async def listen(self, host: str | None, port: int, *, reuse_port: bool = False,
                     backlog: int = 1024) -> Listener:
        """Bind every address `host` names (None or "": all) on `port` (0: a free one, the
        same on each) and start accepting. OSError if one cannot be bound."""
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        seen: set[tuple[int, tuple[object, ...]]] = set()
        try:
            for family, kind, proto, _, resolved in infos:
                if (family, resolved) in seen:
                    continue
                seen.add((family, resolved))
                address = resolved
                if port == 0 and self._sockets:  # the port the first address got
                    address = (resolved[0], self._sockets[0].getsockname()[1], *resolved[2:])
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:  # as asyncio: v4 addresses get their own
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(backlog)
                sock.setblocking(False)
        except BaseException:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
            raise
        for sock in self._sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)
        return self

    def _accept(self, listening: socket.socket) -> None:
        assert self._loop is not None
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, _ = listening.accept()
            except OSError:  # none queued (EAGAIN), or out of descriptors: the next turn
                return
            conn.setblocking(False)
            if self.closed:
                cut_socket(conn)
                continue
            self._unstarted.add(conn)
            task = self._loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        self._unstarted.discard(conn)  # from here the transport (or the except) owns it
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except asyncio.CancelledError:
            pass  # close(): asyncio closes the transport it made
        except OSError:
            cut_socket(conn)

    def close(self) -> None:
        """Stop accepting: the listening sockets close (the kernel resets what waits in
        their queues) and each connection accepted but not yet handed over is reset.
        Connections already handed over are their protocols' to end."""
        if self.closed:
            return
        self.closed = True
        for sock in self._sockets:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets.clear()
        for conn in list(self._unstarted):
            cut_socket(conn)
        self._unstarted.clear()
        for task in list(self._tasks):
            task.cancel()

    async def wait_closed(self, timeout_s: float = 1.0) -> None:
        """Once closed: wait (bounded) until no hand-over is under way."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def listen_streams(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    host: str | None, port: int, *, backlog: int = 1024,
) -> Listener:
    """`asyncio.start_server` on a `Listener`: `handler(reader, writer)` runs as a task
    for each connection."""

    def protocol() -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(), handler)

    return await Listener(protocol).listen(host, port, backlog=backlog)
