"""tests/fetch.py's streamed reads: pieces arrive before the answer ends, lines split
across pieces join, and leaving the block early closes the connection."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from dynamo_ftctl.http1 import ConnectError
from tests import fetch
from tests.loopback import Server

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class OneShot:
    """A loopback server thread that answers one request with `HEAD`, `first`, then
    (once `go` is set) `rest` and the last chunk; `closed` is set when the client hangs up
    before that."""

    def __init__(self, first: bytes, rest: list[bytes]) -> None:
        self.go = threading.Event()
        self.closed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.first, self.rest = first, rest
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            conn.sendall(HEAD + chunk(self.first))
            if not self.go.wait(10):
                return
            try:
                for piece in self.rest:
                    conn.sendall(chunk(piece))
                conn.sendall(b"0\r\n\r\n")
            except OSError:
                self.closed.set()
                return
            conn.settimeout(10)
            try:
                if conn.recv(1) == b"":
                    self.closed.set()
            except OSError:
                self.closed.set()

    def stop(self) -> None:
        self.go.set()
        self.listener.close()
        self.thread.join(15)


def test_pieces_come_before_the_end_and_lines_join_across_them() -> None:
    server = OneShot(b"data: one\n\nda", [b"ta: two\n\n", b"data: [DONE]\n\n"])
    try:
        with fetch.stream("POST", f"http://127.0.0.1:{server.port}/v1/completions",
                          json={"stream": True}, timeout=10) as resp:
            assert resp.status == 200
            assert resp.header("Content-Type") == "text/event-stream"
            pieces = resp.iter_bytes()
            assert next(pieces) == b"data: one\n\nda"  # before the server sent the rest
            server.go.set()
            rest = b"".join(pieces)
        assert rest == b"ta: two\n\ndata: [DONE]\n\n"
    finally:
        server.stop()


def test_iter_lines() -> None:
    server = OneShot(b"a\r\nb", [b"c\n", b"\nd"])
    server.go.set()
    try:
        with fetch.stream("GET", f"http://127.0.0.1:{server.port}/", timeout=10) as resp:
            assert list(resp.iter_lines()) == ["a", "bc", "", "d"]
    finally:
        server.stop()


def test_leaving_early_closes_the_connection() -> None:
    server = OneShot(b"data: one\n\n", [b"x" * 65536] * 64)
    try:
        with fetch.stream("GET", f"http://127.0.0.1:{server.port}/", timeout=10) as resp:
            next(resp.iter_bytes())
        server.go.set()
        assert server.closed.wait(10)
    finally:
        server.stop()


def test_a_refused_connection_raises() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectError), fetch.stream("GET", f"http://127.0.0.1:{port}/", timeout=2):
        pass


def test_the_awaited_stream_reads_pieces_as_they_come() -> None:
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + chunk(b"data: one\n"))
        await writer.drain()
        await go.wait()
        writer.write(chunk(b"\ndata: two\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with Server(handler) as server, \
                fetch.Session(f"http://127.0.0.1:{server.port}", timeout=10) as session, \
                session.stream("POST", "/v1/x", json={}) as resp:
            assert resp.status == 200
            lines = resp.aiter_lines()
            assert await anext(lines) == "data: one"
            go.set()
            assert [line async for line in lines] == ["", "data: two", ""]

    asyncio.run(main())
