"""The shared HTTP/1.1 client against scripted asyncio servers on loopback (port 0)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar, cast

import pytest

from dynamo_ftctl.http1 import (
    BodyTooLarge,
    Client,
    ConnectError,
    Connection,
    ConnectionBroken,
    NoConnection,
    Pool,
    ProtocolError,
    Response,
)
from tests.loopback import Handler, Server
from tests.waiting import until

T = TypeVar("T")


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: its head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, (await reader.readexactly(length) if length else b"")


def answer(status: int, body: bytes, *headers: str) -> bytes:
    """A response with a Content-Length body."""
    lines = "".join(f"{h}\r\n" for h in headers)
    return (f"HTTP/1.1 {status} X\r\n{lines}content-length: {len(body)}\r\n\r\n").encode() + body


def chunked_head(*headers: str) -> bytes:
    lines = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\n{lines}transfer-encoding: chunked\r\n\r\n".encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    """Run a scenario on a fresh loop, bounded."""
    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), timeout=30)

    return asyncio.run(bounded())


def run_with(handler: Handler, scenario: Callable[[Server, Pool], Awaitable[T]]) -> T:
    """Run `scenario` against a loopback server running `handler`, with a fresh pool."""
    async def go() -> T:
        async with Server(handler) as server:
            pool = Pool()
            try:
                return await scenario(server, pool)
            finally:
                pool.close()

    return run(go)


def test_content_length_answers_reuse_one_connection() -> None:
    """Three length-framed answers, each read to the end, travel over one connection; the
    request carries its headers and body."""
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(answer(200, b'{"ok":true}', "content-type: application/json"))

    async def scenario(server: Server, pool: Pool) -> None:
        for i in range(3):
            async with await pool.request("POST", f"{server.url}/v1/x?q=1", b"abc%d" % i,
                                          {"X-Request-Id": f"r{i}"}) as resp:
                assert resp.status == 200
                assert resp.header("content-type") == "application/json"
                assert await resp.read() == b'{"ok":true}'
        assert server.connections == 1

    run_with(handler, scenario)
    assert [body for _, body in seen] == [b"abc0", b"abc1", b"abc2"]
    assert seen[2][0].startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n")
    assert b"\r\nX-Request-Id: r2\r\n" in seen[2][0]


@pytest.mark.parametrize("piece", [1, 5, 4096])
def test_chunked_stream_arrives_piece_by_piece_and_the_connection_is_reused(piece: int) -> None:
    """A chunked SSE body written in pieces of any size comes back whole, chunk by chunk,
    and the connection it came on serves the next request."""
    body = b"".join(b"data: {\"i\": %d}\n\n" % i for i in range(20)) + b"data: [DONE]\n\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        while True:
            await read_request(reader)
            framed = chunked_head("content-type: text/event-stream") + b"".join(
                chunk(body[i:i + 16]) for i in range(0, len(body), 16)) + b"0\r\n\r\n"
            for i in range(0, len(framed), piece):
                writer.write(framed[i:i + piece])
                await writer.drain()

    async def scenario(server: Server, pool: Pool) -> None:
        for _ in range(2):
            async with await pool.request("POST", f"{server.url}/s", b"{}") as resp:
                parts = []
                while piece_ := await resp.next_chunk(5.0):
                    parts.append(piece_)
                assert b"".join(parts) == body
                assert resp.complete
        assert server.connections == 1

    run_with(handler, scenario)


def test_early_close_mid_body_is_a_broken_connection_never_reused() -> None:
    """A server that closes inside a length body: the bytes sent come first, then
    ConnectionBroken; the next request takes a new connection."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
            await writer.drain()
            return
        writer.write(answer(200, b"fine"))
        await writer.drain()
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> None:
        async with await pool.request("GET", server.url) as resp:
            assert await resp.next_chunk(5.0) == b"0123456789"
            with pytest.raises(ConnectionBroken):
                await resp.next_chunk(5.0)
        async with await pool.request("GET", server.url) as resp:
            assert await resp.read() == b"fine"
        assert server.connections == 2

    run_with(handler, scenario)


def test_closed_before_the_answer_and_refused_are_connect_errors() -> None:
    """A connection closed before any byte of the answer, and a refused one, raise ConnectError;
    only the refused one is `NoConnection` (the server never saw the request)."""
    async def handler(reader: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/"

    async def scenario(server: Server, pool: Pool) -> None:
        with pytest.raises(ConnectError) as closed:
            await pool.request("POST", server.url, b"x", head_timeout_s=5.0)
        assert not isinstance(closed.value, NoConnection)
        assert server.connections == 1  # a fresh connection's failure is not retried
        with pytest.raises(NoConnection):
            await pool.request("POST", dead, b"x", connect_timeout_s=5.0)

    run_with(handler, scenario)


def test_a_kept_alive_connection_closed_under_the_request_is_retried_on_a_new_one() -> None:
    """The keep-alive race: a reused connection the server closes without answering gets
    the request again on a fresh connection (which then stays in the pool)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await read_request(reader)
        writer.write(answer(200, b"first" if n == 1 else b"again"))
        await read_request(reader)
        if n == 1:
            return  # the second request on the kept-alive connection: hang up, no answer
        while True:
            writer.write(answer(200, b"again"))
            await read_request(reader)

    async def scenario(server: Server, pool: Pool) -> None:
        async with await pool.request("POST", server.url, b"a") as resp:
            assert await resp.read() == b"first"
        for body in (b"b", b"c"):
            async with await pool.request("POST", server.url, body, head_timeout_s=5.0) as resp:
                assert await resp.read() == b"again"
        assert server.connections == 2

    run_with(handler, scenario)


def test_cancel_mid_body_hangs_up_and_the_connection_is_not_reused() -> None:
    """Cancelling a reader in the middle of a stream closes its connection: the server sees
    the hang-up and the next request opens a new connection."""
    hung_up = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(chunked_head() + chunk(b"first"))
            await writer.drain()
            if not await reader.read(1):  # EOF: the client hung up
                hung_up.set()
            return
        writer.write(answer(200, b"second"))
        await writer.drain()
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> None:
        resp = await pool.request("POST", server.url, b"{}")
        got: list[bytes] = []

        async def consume() -> None:
            async with resp:
                while True:
                    got.append(await resp.next_chunk())

        task = asyncio.ensure_future(consume())
        await until(lambda: bool(got))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(hung_up.wait(), 5)
        async with await pool.request("GET", server.url) as again:
            assert await again.read() == b"second"
        assert got == [b"first"]
        assert server.connections == 2

    run_with(handler, scenario)


def test_stall_between_chunks_times_out() -> None:
    """No byte within the stall timeout after a chunk raises TimeoutError, bounded in time."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await read_request(reader)
        writer.write(chunked_head() + chunk(b"tok"))
        await writer.drain()
        await reader.read()  # nothing more until the client hangs up

    async def scenario(server: Server, pool: Pool) -> float:
        async with await pool.request("POST", server.url, b"{}") as resp:
            assert await resp.next_chunk(5.0) == b"tok"
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError):
                await resp.next_chunk(0.2)
            return loop.time() - started

    assert 0.15 <= run_with(handler, scenario) < 5


class _Conn:
    """What a `Response` asks of its connection (pausing the socket), recorded."""

    def __init__(self) -> None:
        self.exchange: object = None
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def _read(resp: Response, *pieces: bytes) -> None:
    """One socket read whose de-chunked body pieces are `pieces` (as `Connection` calls)."""
    resp.on_read()
    for piece in pieces:
        resp.on_body(piece)
    resp.on_read_end()


def test_a_sink_takes_each_read_whole_and_what_it_refuses_waits_in_order() -> None:
    """A sink gets each read's pieces joined, in the callback; a read it refuses, and
    every read after it until read, come from `next_chunk`, in order; after `end_sink`
    `next_chunk` says b"" once and later reads are buffered as usual."""
    async def scenario() -> tuple[list[bytes], list[bytes]]:
        resp = Response(cast("Connection", _Conn()))
        taken: list[bytes] = []

        def sink(piece: bytes) -> bool:
            taken.append(piece)
            if piece.startswith(b"NO"):
                return False
            if piece == b"END":
                resp.end_sink()
            return True

        read: list[bytes] = []
        _read(resp, b"a")
        read.append(await resp.next_chunk(1.0))
        resp.sink = sink
        _read(resp, b"b", b"b")  # one read, two chunks: one call
        _read(resp, b"NO", b"c")  # refused
        _read(resp, b"d")  # after an unread refusal: not offered
        read.append(await resp.next_chunk(1.0))
        _read(resp, b"END")
        _read(resp, b"tail")  # after the end: buffered
        read.append(await resp.next_chunk(1.0))
        read.append(await resp.next_chunk(1.0))
        return taken, read

    taken, read = run(scenario)
    assert taken == [b"bb", b"NOc", b"END"]
    assert read == [b"a", b"NOcd", b"", b"tail"]


def test_pieces_a_sink_takes_keep_the_stall_timeout_from_expiring() -> None:
    """A reader waits while a sink takes a piece every 50 ms for longer than its stall
    timeout: no TimeoutError until the pieces stop, then one, a timeout after the last."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await read_request(reader)
        writer.write(chunked_head() + chunk(b"first"))
        for i in range(10):
            await asyncio.sleep(0.05)  # the worker's pace, longer in all than the timeout
            writer.write(chunk(b"%d" % i))
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> tuple[list[bytes], float, float]:
        loop = asyncio.get_running_loop()
        taken: list[tuple[bytes, float]] = []
        async with await pool.request("POST", server.url, b"{}") as resp:
            assert await resp.next_chunk(5.0) == b"first"
            resp.sink = lambda piece: taken.append((piece, loop.time())) is None
            started = loop.time()
            with pytest.raises(TimeoutError):
                await resp.next_chunk(0.2)
            return [p for p, _ in taken], taken[-1][1] - started, loop.time() - taken[-1][1]

    pieces, flowing, after_last = run_with(handler, scenario)
    assert pieces == [b"%d" % i for i in range(10)]
    assert flowing > 0.2  # the pieces went on past one timeout
    assert 0.15 <= after_last < 5


def test_body_wait_is_the_time_from_the_request_to_the_first_body_byte() -> None:
    """Headers at once, the body 0.2 s later: `body_wait_s` is None until the body begins,
    then covers the server's wait and fits inside what the caller saw."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await read_request(reader)
        writer.write(chunked_head())
        await writer.drain()
        await asyncio.sleep(0.2)  # the worker's prefill, the thing measured
        writer.write(chunk(b"tok") + b"0\r\n\r\n")
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> tuple[float | None, float, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with await pool.request("POST", server.url, b"{}") as resp:
            before_body = resp.body_wait_s
            assert await resp.next_chunk(5.0) == b"tok"
            seen = loop.time() - started
            assert resp.body_wait_s is not None
            return before_body, resp.body_wait_s, seen

    before_body, wait, seen = run_with(handler, scenario)
    assert before_body is None
    assert 0.2 <= wait <= seen


def test_headers_that_never_come_time_out() -> None:
    """A server that reads the request and never answers: TimeoutError after head_timeout_s."""
    async def handler(reader: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> None:
        with pytest.raises(TimeoutError):
            await pool.request("POST", server.url, b"{}", head_timeout_s=0.2)

    run_with(handler, scenario)


def test_oversize_body_is_refused_and_the_connection_closed() -> None:
    """read(limit) past its limit raises BodyTooLarge; the connection is not reused."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await read_request(reader)
        if n == 1:  # 50 kB of a 10 MB body, the rest never comes
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10000000\r\n\r\n" + b"x" * 50_000)
        else:
            writer.write(answer(200, b"x" * 50_000))
        await writer.drain()
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> None:
        async with await pool.request("GET", server.url) as resp:
            with pytest.raises(BodyTooLarge):
                await resp.read(limit=1000)
        async with await pool.request("GET", server.url) as resp:
            assert len(await resp.read()) == 50_000
        assert server.connections == 2

    run_with(handler, scenario)


def test_unread_stream_pauses_the_socket_and_resumes_when_read() -> None:
    """A body the reader does not read stops the socket being read (backpressure) and
    arrives whole once read."""
    body = bytes(range(256)) * 16 * 1024  # 4 MiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await read_request(reader)
        writer.write(answer(200, body))
        await writer.drain()
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> None:
        async with await pool.request("GET", server.url) as resp:
            await until(lambda: resp.connection.paused)
            assert await resp.read(limit=len(body)) == body

    run_with(handler, scenario)


def test_not_http_is_a_protocol_error() -> None:
    """An answer that is not HTTP raises ProtocolError."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def scenario(server: Server, pool: Pool) -> None:
        with pytest.raises(ProtocolError):
            await pool.request("GET", server.url, head_timeout_s=5.0)

    run_with(handler, scenario)


def test_body_until_close_is_whole_and_the_client_fetches_it() -> None:
    """A body with neither length nor chunks ends when the server closes: Client.fetch
    returns it whole with its status."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Busy\r\ncontent-type: text/plain\r\n\r\nno room")
        await writer.drain()

    async def scenario() -> tuple[int, bytes]:
        async with Server(handler) as server:
            client = Client()
            try:
                return await client.fetch("GET", f"{server.url}/metrics", timeout_s=5.0)
            finally:
                await client.close()

    assert run(scenario) == (503, b"no room")


def test_https_to_a_server_without_tls_is_unreachable() -> None:
    """An https:// URL to a server that does not speak TLS fails with an HttpError (the
    handshake is refused: `NoConnection`), as a plain-http failure would."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      _n: int) -> None:
        await reader.read(1)
        writer.write(b"HTTP/1.1 400 Not TLS\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async def scenario(server: Server, _pool: Pool) -> None:
        client = Client()
        try:
            with pytest.raises(NoConnection):
                await client.request("GET", server.url.replace("http://", "https://"),
                                     connect_timeout_s=5.0, head_timeout_s=5.0)
        finally:
            await client.close()

    run_with(handler, scenario)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (made by the openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_https_answers_come_through_the_same_pool_and_connection_is_reused(
        tls_files: tuple[Path, Path]) -> None:
    """Over TLS a chunked answer is read like a plain one and its connection kept alive:
    two requests, one handshake; a client that does not trust the certificate is refused."""
    cert, key = tls_files
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    connections = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                writer.write(chunked_head() + chunk(b"hello ") + chunk(b"tls") + b"0\r\n\r\n")
                await writer.drain()
        writer.close()

    async def scenario() -> list[tuple[int, bytes]]:
        server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=server_tls)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"
        client, stranger = Client(ssl_context=trusting), Client()
        try:
            got = [await client.fetch("GET", url, timeout_s=10.0) for _ in range(2)]
            with pytest.raises(NoConnection):
                await stranger.fetch("GET", url, timeout_s=10.0)
            return got
        finally:
            await client.close()
            await stranger.close()
            server.close()
            await server.wait_closed()

    assert run(scenario) == [(200, b"hello tls")] * 2
    assert connections == 1  # both requests on one; the refused handshake never got here
