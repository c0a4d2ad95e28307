"""How canary probes reach a worker: one POST of a JSON body, bounded in time and size.

The seam is the package's one (`http1.Transport` for blocking code,
`http1.AsyncTransport` for the daemon); `post_json`/`apost_json` make the POST
and turn every failure into a `TransportError` with a kind the verdicts read.
Two transports are tuned for probes:

- `Http1Transport`: one blocking socket per request, parsed by httptools, for the
  one-shot probe. A probe has 150 ms for everything, interpreter included:
  httpx costs ~60 ms to import and `http.client` ~18 ms (it imports
  `email.parser` and `ssl`); one POST needs no connection pool, and this module
  loads neither asyncio nor http1's client.
- `health.fanout.ClientTransport` (also `AiohttpTransport`, its old name): one
  shared `dynamo_ftctl.http1.Client` for the daemon's fan-out to many workers.

Any other transport (`http1.BlockingClient`, a `MockTransport` in tests) works
too: its `OSError`s are classified by `as_transport_error`.

Both stop at `max_bytes` and at an overall deadline, so a 10 MB body or an SSE
stream that never ends costs at most the timeout. A timeout before any response
header is `timeout` (the worker is unreachable); a body still flowing at the
deadline is `endless_body` (the worker answered, wrongly).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from dynamo_ftctl.health.errors import FailureKind, TransportError
from dynamo_ftctl.http1.errors import (
    BodyTooLarge,
    ConnectError,
    NoConnection,
    ProtocolError,
)
from dynamo_ftctl.http1.transport import AsyncTransport, Reply, Request, Transport

if TYPE_CHECKING:
    import _socket

__all__ = [
    "JSON_HEADERS",
    "MAX_BODY_BYTES",
    "FailureKind",
    "Http1Transport",
    "TransportError",
    "apost_json",
    "as_transport_error",
    "endless",
    "post_json",
    "too_large",
]

# A canary answer is a few KiB; 1 MiB leaves room for long prompts echoed back as ids.
MAX_BODY_BYTES = 1024 * 1024


JSON_HEADERS = {"Content-Type": "application/json"}


def as_transport_error(exc: OSError) -> TransportError:
    """`exc`, a transport's failure, as the `TransportError` a verdict reads."""
    if isinstance(exc, TransportError):
        return exc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, TimeoutError):
        return TransportError("timeout", f"no response in time ({text})")
    if isinstance(exc, NoConnection | ConnectionRefusedError):
        return TransportError("refused", f"cannot connect: {text}")
    if isinstance(exc, BodyTooLarge):
        return TransportError("too_large", f"response body too large ({text})")
    if isinstance(exc, ProtocolError):
        return TransportError("protocol", f"not an HTTP response ({text})")
    if isinstance(exc, ConnectError):
        return TransportError("reset", f"connection lost before answering: {text}")
    return TransportError("reset", f"connection lost: {text}")


def _json_request(url: str, body: bytes, timeout_s: float, headers: Mapping[str, str] | None,
                  max_bytes: int) -> Request:
    sent = JSON_HEADERS if not headers else {**JSON_HEADERS, **headers}
    return Request("POST", url, body, sent, timeout_s, max_bytes)


def post_json(transport: Transport, url: str, body: bytes, *, timeout_s: float,
              headers: Mapping[str, str] | None = None,
              max_bytes: int = MAX_BODY_BYTES) -> Reply:
    """POST `body` (JSON) to `url`; `TransportError` when no complete response came."""
    try:
        return transport.handle_request(_json_request(url, body, timeout_s, headers, max_bytes))
    except OSError as exc:
        raise as_transport_error(exc) from None


async def apost_json(transport: AsyncTransport, url: str, body: bytes, *, timeout_s: float,
                     headers: Mapping[str, str] | None = None,
                     max_bytes: int = MAX_BODY_BYTES) -> Reply:
    """`post_json` for the daemon: the same request and errors, awaited."""
    try:
        return await transport.handle_async_request(
            _json_request(url, body, timeout_s, headers, max_bytes))
    except OSError as exc:
        raise as_transport_error(exc) from None


def too_large(received: int, limit: int) -> TransportError:
    """The error of a body past `limit` bytes (both transports)."""
    return TransportError("too_large", f"response body over {limit:,} bytes "
                                       f"({received:,} received); the limit is {limit:,}")


def endless(received: int, timeout_s: float, content_type: str) -> TransportError:
    """The error of a body still flowing at the deadline (both transports)."""
    return TransportError("endless_body", f"response body did not end within {timeout_s:g} s "
                                          f"({received:,} bytes of {content_type or 'no type'})")


class _Reply:
    """httptools callbacks collecting one response, stopping at `max_bytes`."""

    __slots__ = ("body", "complete", "content_type", "first_at", "framed", "got_headers",
                 "headers", "max_bytes", "overflow")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.content_type = ""
        self.headers: dict[str, str] = {}
        self.got_headers = False
        self.framed = False  # Content-Length or chunked; else the body ends when the peer closes
        self.body = bytearray()
        self.overflow = False
        self.complete = False
        self.first_at: float | None = None  # time.monotonic() of the first body byte

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        self.headers[lower.decode("latin-1")] = value.decode("latin-1")
        if lower == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lower in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.got_headers = True

    def on_body(self, body: bytes) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        if not self.overflow:
            self.body += body
            self.overflow = len(self.body) > self.max_bytes

    def on_message_complete(self) -> None:
        self.complete = True


class Http1Transport:
    """HTTP/1.1 over one blocking socket per call, parsed by httptools (the one-shot probe).

    An `http1.Transport` that raises `TransportError`s. Not `http.client`:
    importing it costs about 18 ms of a probe's 150 ms budget (it pulls in
    `email.parser` and `ssl`); httptools is the C parser the proxy's server
    already uses. `ssl` is imported only for https URLs. A body stops at the
    request's `limit` or `max_bytes`, whichever is smaller.
    """

    def __init__(self, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_bytes = max_bytes

    def handle_request(self, request: Request) -> Reply:
        """The answer to `request`; `TransportError` when no complete response came."""
        url, timeout_s = request.url, request.timeout_s
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        # host[:port]: user info is no part of a Host header, nor of a message
        authority = parts.netloc.rpartition("@")[2]
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        started = time.monotonic()
        deadline = started + timeout_s
        try:
            sock: Any = _connect(host, port, timeout_s)
        except ConnectionRefusedError:
            raise TransportError("refused", f"connection refused by {authority}") from None
        except TimeoutError:
            raise TransportError("timeout", f"no connection within {timeout_s:g} s") from None
        except OSError as exc:
            raise TransportError("refused", f"cannot connect to {authority}: "
                                            f"{exc.strerror or exc}") from None
        reply = _Reply(min(self.max_bytes, request.limit))
        try:
            if https:
                import socket
                import ssl

                plain = socket.socket(fileno=sock.detach())  # ssl wraps socket.socket only
                plain.settimeout(timeout_s)
                sock = ssl.create_default_context().wrap_socket(plain, server_hostname=host)
            sock.sendall(_request(request, authority, parts.path or "/", parts.query))
            status = _read(sock, reply, deadline)
        except TransportError:
            raise
        except TimeoutError:  # socket.timeout is TimeoutError since 3.10
            if reply.got_headers and reply.body:
                raise endless(len(reply.body), timeout_s, reply.content_type) from None
            what = "response body" if reply.got_headers else "response"
            raise TransportError("timeout", f"no {what} within {timeout_s:g} s") from None
        except OSError as exc:  # reset, broken pipe, TLS failure
            raise TransportError("reset", f"connection lost: {exc.__class__.__name__}") from None
        finally:
            sock.close()
        first = None if reply.first_at is None else reply.first_at - started
        return Reply(status, bytes(reply.body), reply.headers, first)


def _connect(host: str, port: int, timeout_s: float) -> _socket.socket:
    """A connected socket, as `socket.create_connection` makes one, from `_socket` alone.

    Importing the `socket` module costs a probe 5-10 ms (it builds enums of every
    constant and imports `selectors`); a probe needs getaddrinfo and connect. An
    ASCII host goes to getaddrinfo as bytes, which skips the IDNA codec and its
    imports (`stringprep`, `unicodedata`). Like `create_connection`, each address
    is tried in turn and the first error is raised when none connects.
    """
    import _socket

    name = host.encode("ascii") if host.isascii() else host
    errors: list[OSError] = []
    for family, kind, proto, _, address in _socket.getaddrinfo(name, port, 0,
                                                               _socket.SOCK_STREAM):
        sock = _socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout_s)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        return sock
    raise errors[0] if errors else OSError(f"no address for {host}")


def _request(request: Request, netloc: str, path: str, query: str) -> bytes:
    target = f"{path}?{query}" if query else path
    body = request.body
    lines = [f"{request.method} {target} HTTP/1.1", f"Host: {netloc}",
             "Accept: application/json", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in request.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _read(sock: Any, reply: _Reply, deadline: float) -> int:
    """Read the response into `reply` until it is complete; its status code."""
    import httptools

    parser = httptools.HttpResponseParser(reply)
    while not reply.complete:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        data = sock.recv(65536)
        if not data:  # the peer closed: the end of an unframed body, else a cut answer
            if reply.got_headers and not reply.framed:
                break
            where = "mid-body" if reply.got_headers else "before answering"
            raise TransportError("reset", f"connection lost: the server closed it {where}")
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise TransportError("protocol", f"not an HTTP response ({exc})") from None
        if reply.overflow:
            raise too_large(len(reply.body), reply.max_bytes)
    return int(parser.get_status_code())
