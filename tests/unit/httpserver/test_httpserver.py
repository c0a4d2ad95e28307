"""The lean HTTP/1.1 server against raw client sockets on loopback (port 0)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest

from dynamo_ftctl.httpserver import (
    Pusher,
    Reply,
    Request,
    Server,
    Stream,
    start_server,
)
from tests.waiting import until

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run a test coroutine on a fresh loop with a deadline."""
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 30)
    return asyncio.run(bounded())


async def echo(request: Request) -> Reply:
    """Answers with the method, path, query, a header and the body it got."""
    tag = request.header(b"x-tag") or b"-"
    return Reply(200, b"%s %s?%s %s %s" % (request.method.encode(), request.path.encode(),
                                           request.query.encode(), tag, request.body),
                 content_type="text/plain", headers={"x-seen": str(len(request.body))})


class Client:
    """One raw connection to the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, server: Server, **kwargs: Any) -> Client:
        port = int(server.address.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, **kwargs)
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """One response: status, headers (lower-cased) and the de-chunked body."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        if "content-length" in headers:
            return status, headers, await self.reader.readexactly(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked"
        body = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += data[:-2]

    async def closed(self) -> bool:
        """The server hung up (EOF) once what it sent is read; the client closes too."""
        try:
            return await asyncio.wait_for(self.reader.read(), 5) == b""
        finally:
            self.close()

    def close(self) -> None:
        self.writer.close()



async def refused(server: Server, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` on a new connection; the answer (status, headers, body), once the
    server has also hung up (asserted)."""
    client = await Client.connect(server)
    client.send(request)
    answer = await client.response()
    assert await client.closed()
    return answer

def serving(handler: Callable[[Request], Awaitable[Reply | Stream]],
            test: Callable[[Server], Awaitable[None]], **kwargs: Any) -> None:
    """Run `test` against a server answering with `handler`, then shut it down."""
    async def go() -> None:
        server = await start_server(handler, "127.0.0.1", 0, **kwargs)
        try:
            await test(server)
        finally:
            await server.shutdown(1.0)
    run(go())


def test_keep_alive_answers_several_requests_on_one_connection() -> None:
    """Requests on one kept-alive connection are each answered, with Content-Length."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        for i in range(3):
            client.send(b"POST /echo?i=%d HTTP/1.1\r\nHost: x\r\nX-Tag: t%d\r\n"
                        b"Content-Length: 5\r\n\r\nhello" % (i, i))
            status, headers, body = await client.response()
            assert status == 200
            assert body == b"POST /echo?i=%d t%d hello" % (i, i)
            assert headers["x-seen"] == "5"
            assert headers["content-type"] == "text/plain"
        client.close()
    serving(echo, test)


def test_pipelined_requests_are_answered_in_order() -> None:
    """Two requests sent in one write get their answers in order."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[2].startswith(b"GET /a?")
        assert (await client.response())[2].startswith(b"GET /b?")
        client.close()
    serving(echo, test)


def test_pipelined_connection_close_is_honoured_per_request() -> None:
    """The second of two pipelined requests asks to close: both answered, then the hang-up."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        _, first, _ = await client.response()
        _, second, body = await client.response()
        assert "connection" not in first
        assert (second["connection"], body[:6]) == ("close", b"GET /b")
        assert await client.closed()
    serving(echo, test)


def test_expect_100_continue_is_answered_before_the_body() -> None:
    """A client that waits for 100 Continue gets it, then sends its body and gets the answer."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 2\r\n\r\n")
        interim = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.send(b"hi")
        assert (await client.response())[2] == b"POST /e? - hi"
        client.close()
    serving(echo, test)


def test_head_gets_the_head_without_the_body() -> None:
    """HEAD is answered with the headers only, and the connection stays usable."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await client.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        client.send(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[2].startswith(b"GET /next?")
        client.close()
    serving(echo, test)


def test_chunked_request_body_is_read_whole() -> None:
    """A chunked request body reaches the handler whole."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        status, _, body = await client.response()
        assert status == 200
        assert body == b"POST /c? - hello world"
        client.close()
    serving(echo, test)


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_request_larger_than_the_bound_is_413_and_never_handled(framing: str) -> None:
    """A body above max_body (declared or streamed) is answered 413 and the connection closed."""
    called: list[Request] = []

    async def handler(request: Request) -> Reply:
        called.append(request)
        return Reply(200, b"")

    async def test(server: Server) -> None:
        if framing == "length":
            request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n"
        else:
            request = (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       + b"40\r\n" + b"x" * 64 + b"\r\n" + b"40\r\n" + b"x" * 64 + b"\r\n")
        status, headers, _ = await refused(server, request)
        assert status == 413
        assert headers["connection"] == "close"
        assert not called
    serving(handler, test, max_body=100)


@pytest.mark.parametrize("garbage", [b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost x\r\n\r\n"])
def test_malformed_http_is_400_and_the_connection_closed(garbage: bytes) -> None:
    """Bytes that are not an HTTP/1.1 request get a 400 and a hang-up."""
    async def test(server: Server) -> None:
        status, _, body = await refused(server, garbage)
        assert status == 400
        assert b"malformed" in body
    serving(echo, test)


def test_oversized_head_is_431_and_never_handled() -> None:
    """Request headers beyond 64 KiB get a 431 and a hang-up, not a handler call."""
    async def test(server: Server) -> None:
        pad = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(70))
        status, _, _ = await refused(server, b"GET / HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n")
        assert status == 431
    serving(echo, test)


def test_handler_failure_is_500() -> None:
    """A handler that raises gets the client a 500, not a hang."""
    async def handler(_: Request) -> Reply:
        msg = "boom"
        raise RuntimeError(msg)

    async def test(server: Server) -> None:
        status, _, _ = await refused(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 500
    serving(handler, test)


def test_stream_is_chunked_and_the_connection_stays_alive() -> None:
    """A `Stream` arrives chunked, piece by piece, and the connection serves the next request."""
    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b"data: 1\n\n", b"", b"data: 2\n\n"):
            yield piece

    async def handler(request: Request) -> Reply | Stream:
        if request.path == "/stream":
            return Stream(pieces(), headers={"x-worker": "w1"})
        return await echo(request)

    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await client.response()
        assert (status, headers["x-worker"], body) == (200, "w1", b"data: 1\n\ndata: 2\n\n")
        assert headers["content-type"].startswith("text/event-stream")
        client.send(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[2].startswith(b"GET /after?")
        client.close()
    serving(handler, test)


def test_a_pusher_writes_between_the_pieces_in_order_and_never_after_the_answer() -> None:
    """Once the head is out, `on_push` gets a Pusher: what it writes arrives chunked, in
    order with the pieces; after the answer it is shut, and the next answer on the
    connection is untouched."""
    pushers: list[Pusher] = []
    go_on = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await go_on.wait()
        yield b"data: 3\n\n"

    async def handler(request: Request) -> Reply | Stream:
        if request.path == "/stream":
            return Stream(pieces(), on_push=pushers.append)
        return await echo(request)

    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: bool(pushers))
        pusher = pushers[0]
        assert pusher.writable
        pusher.write(b"data: 2\n\n")
        pusher.write(b"")  # nothing: not the chunked end
        go_on.set()
        _, _, body = await client.response()
        assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"
        assert not pusher.writable
        client.send(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[2].startswith(b"GET /after?")
        client.close()
    serving(handler, test)


def test_a_pusher_is_not_writable_while_the_client_is_not_reading() -> None:
    """A client that stops reading makes its Pusher refuse (the writer must wait); once it
    reads again the Pusher takes pieces again."""
    pushers: list[Pusher] = []
    done = asyncio.Event()
    piece = b"x" * (256 * 1024)

    async def pieces() -> AsyncIterator[bytes]:
        yield b"first"
        await done.wait()

    async def handler(_: Request) -> Stream:
        return Stream(pieces(), on_push=pushers.append)

    async def test(server: Server) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
        reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: bool(pushers))
        pusher = pushers[0]
        written = 0
        for _ in range(64):  # 16 MiB at most: far more than both socket buffers
            if not pusher.writable:
                break
            pusher.write(piece)
            written += 1
        assert not pusher.writable
        assert written < 64
        expected = len(b"first") + written * len(piece)
        got = 0
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"chunked" in head
        while got < expected:  # read the chunks the pusher left in the buffers
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            got += len((await reader.readexactly(size + 2))[:-2])
        await until(lambda: pusher.writable)
        done.set()
        writer.close()
    serving(handler, test)


def test_http10_client_gets_a_close_delimited_stream() -> None:
    """An HTTP/1.0 client (no chunked coding) gets the stream's bytes raw, ended by a hang-up."""
    async def pieces() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def handler(_: Request) -> Stream:
        return Stream(pieces())

    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /s HTTP/1.0\r\n\r\n")
        raw = await asyncio.wait_for(client.reader.read(), 5)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower()
        assert b"connection: close" in head
        assert body == b"data: 1\n\ndata: 2\n\n"
        client.close()
    serving(handler, test)


def test_client_disconnect_cancels_the_handler() -> None:
    """A client that hangs up mid-answer cancels its handler's task (and what it awaits)."""
    started = asyncio.Event()
    outcome: list[str] = []

    async def handler(_: Request) -> Reply:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return Reply(200, b"late")

    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        client.close()
        await until(lambda: outcome == ["cancelled"])
        await until(lambda: not server.tasks and not server.connections)
    serving(handler, test)


def test_slow_reader_pauses_the_stream_until_it_reads() -> None:
    """A client that stops reading stops the stream being pulled; reading resumes it."""
    piece = b"x" * (64 * 1024)  # 4 MiB in all: ten times what the small buffers below,
    total = 64  # the kernel's and the transport's, hold (the stall is certain, and quick)
    pulled: list[int] = []
    finished = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(total):
            pulled.append(i)
            yield piece
        finished.set()

    async def handler(_: Request) -> Stream:
        return Stream(pieces())

    async def test(server: Server) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
        reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)
        client = Client(reader, writer)
        await until(lambda: server.connections, 10, "the server's side of the connection")
        for conn in server.connections:  # not the 4 MiB loopback autotunes to
            assert conn.transport is not None
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: any(c.writing_paused for c in server.connections), 10,
                    "the stream's writer paused (the client reads nothing)")
        stalled_at = len(pulled)
        await asyncio.sleep(0)  # a paused stream is awaiting its drain: nothing more is pulled
        assert len(pulled) == stalled_at < total
        assert not finished.is_set()
        _, _, body = await client.response()
        assert len(body) == total * len(piece)
        assert finished.is_set()
        client.close()
    serving(handler, test)


def test_shutdown_finishes_answers_in_flight_and_closes_idle_connections() -> None:
    """Shutdown lets a running answer finish, hangs up idle connections, refuses new ones."""
    release = asyncio.Event()
    started = asyncio.Event()

    async def handler(request: Request) -> Reply:
        if request.path == "/slow":
            started.set()
            await release.wait()
        return Reply(200, b"done")

    async def go() -> None:
        server = await start_server(handler, "127.0.0.1", 0)
        port = int(server.address.rsplit(":", 1)[1])
        idle = await Client.connect(server)
        busy = await Client.connect(server)
        busy.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        stopping = asyncio.ensure_future(server.shutdown(10.0))
        assert await idle.closed()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        release.set()
        status, headers, body = await busy.response()
        assert (status, body, headers["connection"]) == (200, b"done", "close")
        await asyncio.wait_for(stopping, 5)
        assert await busy.closed()
    run(go())


def test_shutdown_deadline_cancels_what_is_still_running() -> None:
    """An answer still running at the shutdown deadline is cancelled and its client hung up on."""
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def handler(_: Request) -> Reply:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return Reply(200, b"")

    async def go() -> None:
        server = await start_server(handler, "127.0.0.1", 0)
        client = await Client.connect(server)
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.wait_for(server.shutdown(0.05), 5)
        assert cancelled == [True]
        assert await client.closed()
    run(go())


def test_ipv6_listen_address_is_bracketed() -> None:
    """A server on [::1] reports its address with the host in brackets, and answers there."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")

    async def go() -> None:
        try:
            server = await start_server(echo, "::1", 0)
        except OSError as exc:
            pytest.skip(f"cannot bind [::1]: {exc}")
        try:
            assert server.address.startswith("http://[::1]:")
            port = int(server.address.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("::1", port)
            client = Client(reader, writer)
            client.send(b"GET /six HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.response())[2].startswith(b"GET /six?")
            client.close()
        finally:
            await server.shutdown(1.0)
    run(go())


def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout() -> None:
    """A connection idle between requests (or before its first) is hung up; answers reset it."""
    async def test(server: Server) -> None:
        silent = await Client.connect(server)  # never sends a byte
        client = await Client.connect(server)
        loop = asyncio.get_running_loop()
        for _ in range(3):  # each answer starts the idle clock again
            client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.response())[0] == 200
            await asyncio.sleep(0.1)  # a tenth of the idle timeout: still open
        started = loop.time()
        assert await client.closed()
        assert 0.5 < loop.time() - started < 5
        assert await silent.closed()
    serving(echo, test, idle_timeout_s=1.0)


def test_a_request_not_read_whole_in_time_is_answered_408() -> None:
    """A client that sends half a head (or half a body) and stalls gets 408 and a hang-up."""
    async def test(server: Server) -> None:
        for partial in (b"GET /a HTTP/1.1\r\nHost:", b"POST /a HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 10\r\n\r\nhalf"):
            status, _, body = await refused(server, partial)
            assert status == 408
            assert b"not received within 0.3 s" in body
    serving(echo, test, request_timeout_s=0.3, idle_timeout_s=30)


def test_a_kept_alive_connection_outlives_a_spent_request_timer_and_still_gets_408() -> None:
    """The request timer of an answered request does not close the idle connection, and the
    next request on it still has its own request timeout (the timer is reused, not remade)."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        for _ in range(2):
            client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.response())[0] == 200
        await asyncio.sleep(0.5)  # past the request timeout: idle, not timed out
        client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[0] == 200
        started = asyncio.get_running_loop().time()
        client.send(b"GET /a HTTP/1.1\r\nHost:")
        assert (await client.response())[0] == 408
        assert asyncio.get_running_loop().time() - started < 5
        assert await client.closed()
    serving(echo, test, request_timeout_s=0.3, idle_timeout_s=30)


def test_a_slow_answer_is_not_cut_by_the_timeouts() -> None:
    """An answer that takes longer than both timeouts still arrives whole."""
    async def slow(request: Request) -> Reply:
        await asyncio.sleep(0.6)
        return await echo(request)

    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[0] == 200
        client.close()
    serving(slow, test, request_timeout_s=0.2, idle_timeout_s=0.2)


def test_reuse_port_lets_two_servers_share_a_port_and_both_answer() -> None:
    """`reuse_port=True` (SO_REUSEPORT, `ftctl proxy --procs N`): a second server binds the
    first one's port and answers there; without it the bind fails."""
    async def main() -> None:
        first = await start_server(echo, "127.0.0.1", 0, reuse_port=True)
        port = int(first.address.rsplit(":", 1)[1])
        try:
            with pytest.raises(OSError, match="in use"):
                await start_server(echo, "127.0.0.1", port)
            second = await start_server(echo, "127.0.0.1", port, reuse_port=True)
            try:
                assert second.address == first.address
                await first.shutdown(1.0)  # the port stays served by the second one
                client = await Client.connect(second)
                client.send(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
                status, _, body = await client.response()
                assert (status, body) == (200, b"GET /x? - ")
                client.writer.close()
            finally:
                await second.shutdown(1.0)
        finally:
            await first.shutdown(1.0)
    run(main())
