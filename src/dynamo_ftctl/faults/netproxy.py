"""The TCP fault proxy: a toxiproxy-like asyncio relay with toxics changed at run time.

`NetProxy` listens on one address and relays every connection to one
upstream. Toxics act on one direction each ("downstream": upstream → client,
the default, as in toxiproxy; "upstream": client → upstream):

    latency     delay every chunk by latency_ms ± jitter_ms (order kept)
    bandwidth   at most rate_kbps KiB/s
    reset_peer  reset (RST) every connection, now and new ones, after timeout_ms
    blackhole   accept, read and drop everything; never answer
    slice       split writes into ~size_bytes pieces, delay_us apart
    limit_data  close the connection once `bytes` have passed

`on_downstream(connection, piece)`, when given, is told each piece as the relay writes it
to a client, on the relay's loop, before the next one: a test's trigger that acts where
the relay is (a client that lags behind can hold the whole answer before it sees a token).

`ControlServer` exposes them over a small HTTP/JSON API (what the `net`
injector and `ftctl inject netproxy` speak): `GET /toxics`, `POST /toxics`
(a toxic as JSON), `DELETE /toxics/{name}`, `DELETE /toxics`, `GET /health`.
POST and DELETE need `Authorization: Bearer <token>` (`dynamo_ftctl.auth`;
no token given to the server: 403, refused; `ftctl inject netproxy` reads it
from $FTCTL_NETPROXY_TOKEN): a toxic cuts or stalls every client of a worker.
This module owns sockets only; it knows nothing of workers or the inventory.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.auth import NETPROXY_TOKEN_ENV, check_bearer
from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from dynamo_ftctl.httpapp import Router
    from dynamo_ftctl.httpserver import Handler, Listener, Reply, Request, Server, Stream

__all__ = [
    "TOXIC_KINDS", "ControlServer", "NetProxy", "NetProxyInfo", "Toxic", "parse_toxic",
    "serve_netproxy", "split_host_port",
]

ToxicKind = Literal["latency", "bandwidth", "reset_peer", "blackhole", "slice", "limit_data"]
Direction = Literal["downstream", "upstream"]
TOXIC_KINDS: tuple[str, ...] = (
    "latency", "bandwidth", "reset_peer", "blackhole", "slice", "limit_data",
)
_READ_SIZE = 64 * 1024
# Bandwidth is paced in pieces of 1/100 s of the rate so a 10% bound holds over short runs.
_PACING_SLICES_PER_S = 100


@dataclass(frozen=True)
class Toxic:
    """One runtime fault of the proxy, on one direction."""

    name: str
    kind: ToxicKind
    direction: Direction = "downstream"
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_kbps: float = 0.0  # KiB/s, as toxiproxy's bandwidth toxic
    timeout_ms: float = 0.0
    size_bytes: int = 0
    delay_us: float = 0.0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The toxic as the control API shows it (only the fields its kind uses)."""
        used = {
            "latency": ("latency_ms", "jitter_ms"),
            "bandwidth": ("rate_kbps",),
            "reset_peer": ("timeout_ms",),
            "blackhole": (),
            "slice": ("size_bytes", "delay_us"),
            "limit_data": ("bytes",),
        }[self.kind]
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "direction": self.direction}
        out.update({key: getattr(self, key) for key in used})
        return out


_NUMBER_FIELDS = ("latency_ms", "jitter_ms", "rate_kbps", "timeout_ms", "delay_us")
_INT_FIELDS = ("size_bytes", "bytes")


def parse_toxic(body: Any) -> Toxic:
    """A `Toxic` from a JSON object; `InvalidInput` names the bad field."""
    if not isinstance(body, Mapping):
        msg = "a toxic must be a JSON object with a 'kind'"
        raise InvalidInput(msg)
    kind = body.get("kind")
    if kind not in TOXIC_KINDS:
        msg = f"unknown toxic kind {kind!r}; expected one of {', '.join(TOXIC_KINDS)}"
        raise InvalidInput(msg)
    direction = body.get("direction", "downstream")
    if direction not in ("downstream", "upstream"):
        msg = f"toxic direction must be 'downstream' or 'upstream', got {direction!r}"
        raise InvalidInput(msg)
    allowed = {"name", "kind", "direction", *_NUMBER_FIELDS, *_INT_FIELDS}
    extra = sorted(set(body) - allowed)
    if extra:
        msg = f"unknown toxic field {extra[0]!r}"
        raise InvalidInput(msg)
    values: dict[str, Any] = {}
    for key in (*_NUMBER_FIELDS, *_INT_FIELDS):
        if key not in body:
            continue
        value = body[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            msg = f"toxic field {key!r} must be a non-negative number, got {value!r}"
            raise InvalidInput(msg)
        values[key] = int(value) if key in _INT_FIELDS else float(value)
    if kind == "bandwidth" and values.get("rate_kbps", 0) <= 0:
        msg = "a bandwidth toxic needs 'rate_kbps' > 0"
        raise InvalidInput(msg)
    if kind == "slice" and values.get("size_bytes", 0) <= 0:
        msg = "a slice toxic needs 'size_bytes' > 0"
        raise InvalidInput(msg)
    name = str(body.get("name") or f"{kind}_{direction}")
    return Toxic(name=name, kind=kind, direction=direction, **values)


@dataclass(eq=False)  # hashed by identity: live connections sit in a set
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    passed: dict[str, int] = field(default_factory=lambda: {"downstream": 0, "upstream": 0})
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER 0), the way a crashed peer's kernel answers."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _cut(conn: _Connection) -> None:
    """Reset both sides of a relayed connection."""
    _reset(conn.client)
    _reset(conn.upstream)


class NetProxy:
    """A TCP relay from `listen` to `upstream` with runtime toxics."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1",
                 port: int = 0, seed: int | None = None,
                 on_downstream: Callable[[object, bytes], None] | None = None) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.host = host
        self.port = port
        self._toxics: dict[str, Toxic] = {}
        self._listener: Listener | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._random = random.Random(seed)
        self.accepted = 0
        self.on_downstream = on_downstream  # (the connection, an opaque key; the piece)

    # -- toxics -------------------------------------------------------------
    def add_toxic(self, toxic: Toxic) -> Toxic:
        """Add or replace a toxic by name; a reset acts on live connections too."""
        self._toxics[toxic.name] = toxic
        if toxic.kind == "reset_peer":
            for conn in list(self._connections):
                self._schedule_reset(conn, toxic)
        return toxic

    def remove_toxic(self, name: str) -> bool:
        """Remove one toxic; False when there was none of that name."""
        return self._toxics.pop(name, None) is not None

    def clear(self) -> int:
        """Remove every toxic; how many there were."""
        count = len(self._toxics)
        self._toxics.clear()
        return count

    def toxics(self) -> tuple[Toxic, ...]:
        """The active toxics, in the order they were added."""
        return tuple(self._toxics.values())

    @property
    def live(self) -> int:
        """How many relayed connections are open now."""
        return len(self._connections)

    def _active(self, direction: str) -> list[Toxic]:
        return [t for t in self._toxics.values() if t.direction == direction]

    # -- life cycle ---------------------------------------------------------
    async def start(self) -> NetProxy:
        """Listen; `port` holds the bound port afterwards (0 picks a free one)."""
        from dynamo_ftctl.httpserver import listen_streams

        self._listener = await listen_streams(self._handle, self.host, self.port)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening and cut (RST) every connection, also one accepted as it stops;
        returns once every socket the relay opened is closed (within ~2 s)."""
        listener, self._listener = self._listener, None  # None: stopping
        if listener is not None:
            listener.close()
        for conn in list(self._connections):
            _cut(conn)
        for task in list(self._handlers):
            task.cancel()
        if listener is not None:
            await listener.wait_closed(1.0)
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=1.0)

    async def __aenter__(self) -> NetProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- relaying -----------------------------------------------------------
    def _close(self, conn: _Connection) -> None:
        for writer in (conn.client, conn.upstream):
            if writer is not None and not writer.is_closing():
                writer.close()

    def _schedule_reset(self, conn: _Connection, toxic: Toxic) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            if conn in self._connections and toxic.name in self._toxics:
                _cut(conn)

        loop.call_later(toxic.timeout_ms / 1000.0, fire)

    async def _connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The upstream connection, within 5 s. Cancel-safe: the socket is the relay's own
        until a transport holds it (a wait_for around open_connection can lose a transport
        that was made just as it was cancelled)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.upstream_host, self.upstream_port,
                                       type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(loop.sock_connect(sock, address), 5.0)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._listener is None:  # handed over as the relay stopped
            _reset(writer)
            return
        conn = _Connection(client=writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._connections.add(conn)
        try:
            for toxic in self._toxics.values():
                if toxic.kind == "reset_peer":
                    self._schedule_reset(conn, toxic)
            try:
                up_reader, conn.upstream = await self._connect_upstream()
            except (TimeoutError, OSError):
                _reset(writer)
                return
            conn.tasks = [
                asyncio.ensure_future(self._pipe(conn, reader, conn.upstream, "upstream")),
                asyncio.ensure_future(self._pipe(conn, up_reader, writer, "downstream")),
            ]
            await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_COMPLETED)
            # One side ended: let the other finish writing what it holds, bounded.
            await asyncio.wait(conn.tasks, timeout=1.0)
        except asyncio.CancelledError:
            pass  # stop(): asyncio's stream callback would log a cancelled handler as an error
        finally:
            for pipe in conn.tasks:
                pipe.cancel()
            await self._closed(conn)
            self._connections.discard(conn)
            self._handlers.discard(task)

    async def _closed(self, conn: _Connection) -> None:
        """Close both sides, flushing what they hold for at most 1 s, then cut them: a
        peer that stops reading must not keep a socket open past the relay's stop."""
        self._close(conn)
        for writer in (conn.client, conn.upstream):
            if writer is None:
                continue
            try:
                await asyncio.wait_for(asyncio.shield(writer.wait_closed()), 1.0)
            except (TimeoutError, asyncio.CancelledError, ConnectionError, OSError):
                _reset(writer)

    async def _pipe(self, conn: _Connection, src: asyncio.StreamReader,
                    dst: asyncio.StreamWriter, direction: str) -> None:
        next_send = time.monotonic()  # bandwidth pacing
        last_release = 0.0  # latency keeps chunks in order
        try:
            while True:
                chunk = await src.read(_READ_SIZE)
                arrived = time.monotonic()
                if not chunk:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                toxics = self._active(direction)
                if any(t.kind == "blackhole" for t in toxics):
                    continue
                for toxic in toxics:
                    if toxic.kind == "latency":
                        jitter = toxic.jitter_ms * (2 * self._random.random() - 1)
                        release = max(arrived + (toxic.latency_ms + jitter) / 1000.0,
                                      last_release)
                        last_release = release
                        await asyncio.sleep(release - time.monotonic())
                limit = next((t for t in toxics if t.kind == "limit_data"), None)
                if limit is not None:
                    room = limit.bytes - conn.passed[direction]
                    if room <= 0:
                        self._close(conn)
                        return
                    chunk = chunk[:room]
                pieces = [chunk]
                slicer = next((t for t in toxics if t.kind == "slice"), None)
                if slicer is not None:
                    size = slicer.size_bytes
                    pieces = [chunk[i:i + size] for i in range(0, len(chunk), size)]
                bandwidth = next((t for t in toxics if t.kind == "bandwidth"), None)
                if bandwidth is not None:
                    rate = bandwidth.rate_kbps * 1024.0
                    step = max(1, int(rate / _PACING_SLICES_PER_S))
                    pieces = [p[i:i + step] for p in pieces for i in range(0, len(p), step)]
                    next_send = max(next_send, time.monotonic())
                for index, piece in enumerate(pieces):
                    if bandwidth is not None:
                        await asyncio.sleep(next_send - time.monotonic())
                        next_send += len(piece) / rate
                    elif slicer is not None and index:
                        await asyncio.sleep(slicer.delay_us / 1e6)
                    dst.write(piece)
                    if direction == "downstream" and self.on_downstream is not None:
                        self.on_downstream(conn, piece)
                    await dst.drain()
                conn.passed[direction] += len(chunk)
                if limit is not None and conn.passed[direction] >= limit.bytes:
                    self._close(conn)
                    return
        except (ConnectionError, OSError):
            return


class ControlServer:
    """The HTTP/JSON control API of one `NetProxy` (the package's HTTP server, loopback
    by default)."""

    def __init__(self, proxy: NetProxy, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, token_env: str = NETPROXY_TOKEN_ENV) -> None:
        self.proxy = proxy
        self.host = host
        self.port = port
        self.token = token  # None: POST and DELETE are refused (403)
        self.token_env = token_env  # only named in the 403's message
        self._server: Server | None = None

    @property
    def url(self) -> str:
        """Base URL of the control API."""
        return f"http://{self.host}:{self.port}"

    def app(self) -> Router:
        """The routes (no state outside the proxy); POST and DELETE need the token."""
        from dynamo_ftctl.httpapp import Router, json_reply, request_json, request_params

        unset = f"toxics disabled: no control token (set ${self.token_env})"

        def authorized(handler: Handler) -> Handler:
            async def checked(request: Request) -> Reply | Stream:
                header = request.header(b"authorization")
                denied = check_bearer(None if header is None else header.decode("latin-1"),
                                      self.token, unset=unset)
                if denied is not None:
                    return json_reply({"error": denied.message}, denied.status, denied.headers)
                return await handler(request)
            return checked

        async def health(_: Request) -> Reply:
            return json_reply({"status": "ok", "listen": self.proxy.port,
                               "upstream": f"{self.proxy.upstream_host}:"
                                           f"{self.proxy.upstream_port}"})

        async def list_toxics(_: Request) -> Reply:
            return json_reply({"toxics": [t.to_json() for t in self.proxy.toxics()]})

        async def add(request: Request) -> Reply:
            try:
                toxic = self.proxy.add_toxic(parse_toxic(request_json(request)))
            except (InvalidInput, ValueError) as exc:
                return json_reply({"error": str(exc)}, 400)
            return json_reply(toxic.to_json(), 201)

        async def remove(request: Request) -> Reply:
            name = request_params(request)["name"]
            if not self.proxy.remove_toxic(name):
                return json_reply({"error": f"no toxic named {name!r}"}, 404)
            return json_reply({"removed": name})

        async def clear(_: Request) -> Reply:
            return json_reply({"removed": self.proxy.clear()})

        router = Router()
        router.get("/health", health)
        router.get("/toxics", list_toxics)
        router.post("/toxics", authorized(add))
        router.delete("/toxics", authorized(clear))
        router.delete("/toxics/{name}", authorized(remove))
        return router

    async def start(self) -> ControlServer:
        """Serve the control API; `port` holds the bound port afterwards."""
        from dynamo_ftctl.httpserver import start_server

        self._server = await start_server(self.app(), self.host, self.port)
        self.port = int(self._server.address.rsplit(":", 1)[1])
        return self

    async def stop(self) -> None:
        """Stop serving the control API."""
        if self._server is not None:
            await self._server.shutdown(1.0)
            self._server = None


def split_host_port(text: str, *, what: str) -> tuple[str, int]:
    """`127.0.0.1:8000` -> ("127.0.0.1", 8000); `InvalidInput` names `what` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        msg = f"{what}: expected HOST:PORT, got {text!r}"
        raise InvalidInput(msg)
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class NetProxyInfo:
    """Where a running fault proxy listens (printed once it serves)."""

    listen: str
    upstream: str
    control: str


async def serve_netproxy(listen: str, upstream: str, control: str,
                         on_ready: Callable[[NetProxyInfo], None], *, token: str,
                         token_env: str = NETPROXY_TOKEN_ENV) -> None:
    """Run a fault proxy and its control API (bearer `token`) until cancelled (Ctrl-C)."""
    host, port = split_host_port(listen, what="--listen")
    up_host, up_port = split_host_port(upstream, what="--upstream")
    ctl_host, ctl_port = split_host_port(control, what="--control")
    proxy = await NetProxy(up_host, up_port, host=host, port=port).start()
    server = ControlServer(proxy, host=ctl_host, port=ctl_port, token=token,
                           token_env=token_env)
    try:
        await server.start()
        on_ready(NetProxyInfo(listen=f"{host}:{proxy.port}", upstream=f"{up_host}:{up_port}",
                              control=server.url))
        await asyncio.Event().wait()
    finally:
        await server.stop()
        await proxy.stop()
