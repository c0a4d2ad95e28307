"""Both canary transports (the one-shot probe's blocking `Http1Transport` and the daemon's
`ClientTransport` over http1) against a scripted loopback server: one contract."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from dynamo_ftctl.health.fanout import ClientTransport
from dynamo_ftctl.health.transport import (
    Http1Transport,
    TransportError,
    apost_json,
    post_json,
)
from dynamo_ftctl.http1 import Reply

Script = Callable[[socket.socket, bytes], None]


class _BlockingClientTransport:
    """`ClientTransport` (the daemon's) driven one call at a time, for the same contract."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes

    def post_json(self, url: str, body: bytes, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> Reply:
        async def once() -> Reply:
            transport = (ClientTransport() if self.max_bytes is None
                         else ClientTransport(max_bytes=self.max_bytes))
            try:
                return await apost_json(transport, url, body, timeout_s=timeout_s,
                                        headers=headers)
            finally:
                await transport.close()

        return asyncio.run(once())


class _Http1Poster:
    """`Http1Transport` (the one-shot probe's) through `post_json`, as the probe calls it."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.transport = Http1Transport() if max_bytes is None \
            else Http1Transport(max_bytes=max_bytes)

    def post_json(self, url: str, body: bytes, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> Reply:
        return post_json(self.transport, url, body, timeout_s=timeout_s, headers=headers)


def _make_http1(max_bytes: int | None = None) -> _Http1Poster:
    return _Http1Poster(max_bytes)


@pytest.fixture(params=["blocking", "client"])
def make(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Both transports: the one-shot probe's blocking one and the daemon's http1 one."""
    return _make_http1 if request.param == "blocking" else _BlockingClientTransport


class RawServer:
    """Accepts connections on 127.0.0.1 and runs `script(conn, request)` on each."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.script: Script = lambda conn, request: None
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (OSError, ssl.SSLError):  # a client that refused the certificate
                    conn.close()
                    continue
            with conn:
                conn.settimeout(5)
                request = _read_request(conn)
                self.requests.append(request)
                with contextlib.suppress(OSError):  # the client hung up first (timeouts, oversize)
                    self.script(conn, request)


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@contextlib.contextmanager
def _running(srv: RawServer) -> Iterator[RawServer]:
    try:
        yield srv
    finally:
        srv.stop.set()
        srv.thread.join(timeout=5)
        srv.sock.close()


@pytest.fixture
def server() -> Iterator[RawServer]:
    with _running(RawServer()) as srv:
        yield srv


def _send(raw: bytes) -> Script:
    return lambda conn, _: conn.sendall(raw)


def test_content_length_answer_and_request_shape(
        server: RawServer, make: Callable[..., Any]) -> None:
    """A framed answer comes back whole; the request carries host, length, headers, body."""
    server.script = _send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 12\r\n\r\n{\"ok\": true}")
    reply = make().post_json(server.url, b'{"a": 1}', timeout_s=5,
                                       headers={"Authorization": "Bearer t"})
    assert (reply.status, reply.content_type) == (200, "application/json")
    assert reply.body == b'{"ok": true}'
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}".encode() in head
    assert b"Authorization: Bearer t" in head
    assert body == b'{"a": 1}'


def test_chunked_answer_is_decoded(server: RawServer, make: Callable[..., Any]) -> None:
    """Transfer-Encoding: chunked bodies are joined without the chunk framing."""
    server.script = _send(b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n"
                          b"Content-Type: text/plain\r\n\r\n4\r\nbusy\r\n3\r\n!!!\r\n0\r\n\r\n")
    reply = make().post_json(server.url, b"{}", timeout_s=5)
    assert (reply.status, reply.body, reply.content_type) == (503, b"busy!!!", "text/plain")


def test_unframed_body_ends_when_the_server_closes(
        server: RawServer, make: Callable[..., Any]) -> None:
    """An HTTP/1.0-style body with neither length nor chunks is read until close."""
    server.script = _send(b"HTTP/1.0 502 Bad Gateway\r\nContent-Type: text/html\r\n\r\n"
                          b"<html>502</html>")
    reply = make().post_json(server.url, b"{}", timeout_s=5)
    assert (reply.status, reply.body) == (502, b"<html>502</html>")


def test_framed_body_cut_short_is_a_reset(server: RawServer, make: Callable[..., Any]) -> None:
    """A server that closes before Content-Length bytes arrived lost the connection."""
    server.script = _send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"choi")
    with pytest.raises(TransportError) as err:
        make().post_json(server.url, b"{}", timeout_s=5)
    assert err.value.kind == "reset"
    assert err.value.transient
    assert "mid-body" in err.value.message


def test_close_before_answering_is_a_reset(server: RawServer, make: Callable[..., Any]) -> None:
    """A connection closed with no response at all is a (transient) reset."""
    server.script = lambda conn, _: None
    with pytest.raises(TransportError) as err:
        make().post_json(server.url, b"{}", timeout_s=5)
    assert (err.value.kind, err.value.transient) == ("reset", True)


def test_not_http_is_a_protocol_error(server: RawServer, make: Callable[..., Any]) -> None:
    """Bytes that are not an HTTP response are named as such."""
    server.script = _send(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
    with pytest.raises(TransportError) as err:
        make().post_json(server.url, b"{}", timeout_s=5)
    assert err.value.kind == "protocol"
    assert "not an HTTP response" in err.value.message


def test_oversize_body_stops_at_the_limit(server: RawServer, make: Callable[..., Any]) -> None:
    """A body over max_bytes is refused as soon as the limit is passed."""
    server.script = _send(b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n"
                          + b"x" * 200_000)
    with pytest.raises(TransportError) as err:
        make(10_000).post_json(server.url, b"{}", timeout_s=5)
    assert err.value.kind == "too_large"
    assert "10,000" in err.value.message


def _trickle(conn: socket.socket, _: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    for _i in range(200):  # bounded: 200 x 20 ms, far past the client's 0.3 s deadline
        conn.sendall(b"f\r\ndata: {\"x\": 1}\n\r\n")
        time.sleep(0.02)


def test_endless_body_is_cut_at_the_deadline(server: RawServer, make: Callable[..., Any]) -> None:
    """A stream still flowing at the deadline is `endless_body`, after about the timeout."""
    server.script = _trickle
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        make().post_json(server.url, b"{}", timeout_s=0.3)
    assert err.value.kind == "endless_body"
    assert "text/event-stream" in err.value.message
    assert time.monotonic() - start < 3


def test_silence_is_a_timeout(server: RawServer, make: Callable[..., Any]) -> None:
    """No response header within the timeout: `timeout`, unreachable, not transient."""
    done = threading.Event()
    server.script = lambda conn, _: done.wait(5)
    try:
        with pytest.raises(TransportError) as err:
            make().post_json(server.url, b"{}", timeout_s=0.2)
    finally:
        done.set()
    assert (err.value.kind, err.value.unreachable, err.value.transient) == (
        "timeout", True, False)


def test_refused_port_is_refused(make: Callable[..., Any]) -> None:
    """Nothing listening: `refused` with the address in the message."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransportError) as err:
        make().post_json(f"http://127.0.0.1:{port}/v1/completions", b"{}",
                                   timeout_s=2)
    assert err.value.kind == "refused"
    assert f"127.0.0.1:{port}" in err.value.message


def test_a_name_with_several_addresses_tries_each(
        server: RawServer, make: Callable[..., Any]) -> None:
    """`localhost` may resolve to ::1 first, where nothing listens; 127.0.0.1 answers."""
    server.script = _send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    reply = make().post_json(f"http://localhost:{server.port}/v1/completions",
                                       b"{}", timeout_s=5)
    assert (reply.status, reply.body) == (200, b"{}")


@pytest.fixture
def tls_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RawServer]:
    """A loopback server with a self-signed certificate for 127.0.0.1 that clients trust."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read by ssl.create_default_context()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with _running(RawServer(tls=context)) as srv:
        yield srv


def test_https_answer_over_verified_tls(tls_server: RawServer, make: Callable[..., Any]) -> None:
    tls_server.script = _send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 8\r\n\r\n{\"a\": 1}")
    url = f"https://127.0.0.1:{tls_server.port}/v1/completions"
    reply = make().post_json(url, b'{"q": 2}', timeout_s=5)
    assert (reply.status, reply.body, reply.content_type) == (200, b'{"a": 1}',
                                                              "application/json")
    assert tls_server.requests[0].endswith(b'{"q": 2}')


def test_https_silence_is_a_timeout(tls_server: RawServer, make: Callable[..., Any]) -> None:
    """The deadline still holds once the socket is wrapped for TLS."""
    release = threading.Event()
    tls_server.script = lambda conn, _: release.wait(5)
    start = time.monotonic()
    try:
        with pytest.raises(TransportError) as err:
            make().post_json(f"https://127.0.0.1:{tls_server.port}/", b"{}",
                                       timeout_s=0.3)
    finally:
        release.set()
    assert err.value.kind == "timeout"
    assert time.monotonic() - start < 3
