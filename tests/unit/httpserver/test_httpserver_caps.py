"""The lean HTTP/1.1 server's caps (connections, buffered request bytes) and ignored
upgrades, against raw client sockets on loopback (port 0)."""

from __future__ import annotations

import asyncio
import resource
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from dynamo_ftctl.httpserver import Reply, Request, Server, default_max_connections
from tests.unit.httpserver.test_httpserver import Client, echo, refused, serving
from tests.waiting import until, wait_until

GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_connection_over_the_cap_is_answered_503_and_the_others_are_served() -> None:
    """With max_connections held, one more client gets 503 + Retry-After and a hang-up;
    the held ones are still served, and a freed slot serves a new client."""
    async def test(server: Server) -> None:
        held = [await Client.connect(server) for _ in range(3)]
        await until(lambda: len(server.connections) == 3)
        status, headers, body = await refused(server, GET)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert b"over 3 connections" in body
        assert server.refused_connections == 1
        held[0].send(GET)
        assert (await held[0].response())[0] == 200
        held[1].close()
        await until(lambda: len(server.connections) == 2)
        fresh = await Client.connect(server)
        fresh.send(GET)
        assert (await fresh.response())[0] == 200
        for client in (held[0], held[2], fresh):
            client.close()
        await until(lambda: not server.connections and not server.refusing)
    serving(echo, test, max_connections=3)


def test_the_default_connection_cap_leaves_room_under_the_open_file_limit() -> None:
    """Clients, their upstream connections and refusals fit under the limit: 4096 at most."""
    for limit in (64, 128, 1024, 4096, 65536, 1 << 20):
        cap = default_max_connections(limit)
        assert 16 <= cap <= 4096
        if limit >= 128:
            assert cap * 2 + cap // 4 < limit
    assert default_max_connections(1 << 20) == 4096


# A server in its own process with 128 descriptors at most: the test's clients are not
# counted against it, and what it does at its limit is what a proxy at its limit does.
_LIMITED_SERVER = textwrap.dedent("""
    import asyncio, resource
    from dynamo_ftctl.httpserver import Reply, start_server
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    async def echo(request):
        return Reply(200, b"ok")

    async def main():
        server = await start_server(echo, "127.0.0.1", 0)
        print(server.address.rsplit(":", 1)[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def _answer(sock: socket.socket) -> bytes:
    """What the server sent until the end of one head (or its hang-up)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(4096)
        if not piece:
            break
        data += piece
    return data


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 600,
                    reason="the test's own 250 client sockets need descriptors")
def test_clients_past_the_open_file_limit_are_answered_not_reset() -> None:
    """250 clients of a server limited to 128 descriptors each get an answer (200 up to
    the cap, then 503), none is reset or left hanging, and once they leave a new client
    is served."""
    proc = subprocess.Popen([sys.executable, "-c", _LIMITED_SERVER], stdout=subprocess.PIPE,
                            text=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        statuses: list[int] = []
        for _ in range(250):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(sock)
            sock.sendall(GET)
            head = _answer(sock)
            assert head.startswith(b"HTTP/1.1 "), f"client {len(socks)} got {head!r}"
            statuses.append(int(head.split()[1]))
            if statuses[-1] != 200:
                sock.close()  # what a client does after `connection: close`
        served = statuses.count(200)
        assert 16 <= served < 128
        assert statuses == [200] * served + [503] * (250 - served)
        for sock in socks:
            sock.close()
        socks.clear()

        def answer_to_one_more() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(GET)
                return _answer(sock)

        # The server notices the hang-ups (and its refusals linger 1 s).
        wait_until(answer_to_one_more, 10, "a 200 once the clients hung up",
                   accept=lambda head: head.startswith(b"HTTP/1.1 200"), interval=0.05)
    finally:
        for sock in socks:
            sock.close()
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_request_bytes_over_the_total_cap_are_refused_and_released() -> None:
    """Partial bodies count against max_buffered across connections: a request that
    would go over gets 503 (declared or streamed) and never reaches the handler; the
    bytes come back when a connection closes or its request is answered."""
    handled: list[int] = []

    async def handler(request: Request) -> Reply:
        handled.append(len(request.body))
        return Reply(200, b"")

    async def test(server: Server) -> None:
        slow = await Client.connect(server)
        slow.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n" + b"a" * 50000)
        await until(lambda: server.buffered >= 50000)
        # Declared: refused before its body is sent.
        status, headers, _ = await refused(
            server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n")
        assert (status, headers["retry-after"]) == (503, "1")
        # Streamed (chunked): refused when the piece that goes over arrives.
        status, _, _ = await refused(
            server, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"7530\r\n" + b"b" * 30000 + b"\r\n" + b"7530\r\n" + b"b" * 30000 + b"\r\n")
        assert status == 503
        assert 50000 <= server.buffered < 51000  # the slow head and body, nothing of the two
        assert not handled
        slow.close()
        await until(lambda: server.buffered == 0)
        client = await Client.connect(server)
        client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 90000\r\n\r\n"
                    + b"c" * 90000)
        assert (await client.response())[0] == 200
        assert handled == [90000]
        await until(lambda: server.buffered == 0)  # answered: released
        client.close()
    serving(handler, test, max_buffered=100_000)


def test_pipelined_requests_keep_their_bytes_until_answered() -> None:
    """A request waiting behind another holds its bytes; both answered, nothing is held."""
    gate = asyncio.Event()

    async def handler(request: Request) -> Reply:
        if request.path == "/first":
            await gate.wait()
        return Reply(200, request.body)

    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
                    b"POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo")
        await until(lambda: server.buffered > 6)
        gate.set()
        assert (await client.response())[2] == b"one"
        assert (await client.response())[2] == b"two"
        await until(lambda: server.buffered == 0)
        client.close()
    serving(handler, test)


_H2C = (b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n")


def test_an_h2c_upgrade_is_answered_in_http11_and_the_connection_goes_on() -> None:
    """`Upgrade: h2c` (with and without a body, the body split across reads) is ignored:
    HTTP/1.1 answers, and the next request on the connection is answered too."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n" + _H2C + b"\r\n"
                    b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response())[2] == b"GET /a? - "
        assert (await client.response())[2] == b"GET /b? - "
        client.send(b"POST /c HTTP/1.1\r\nHost: x\r\n" + _H2C + b"Content-Length: 11\r\n\r\nhel")
        await asyncio.sleep(0.05)  # a later read brings the rest of the body
        client.send(b"lo world" + b"GET /d HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await client.response()
        assert (status, body) == (200, b"POST /c? - hello world")
        assert (await client.response())[2] == b"GET /d? - "
        client.close()
        await until(lambda: server.buffered == 0)
    serving(echo, test)


@pytest.mark.parametrize(("target", "status"), [(b"example.com:443", 400), (b"/tunnel", 200)])
def test_connect_gets_one_answer_and_the_tunnel_bytes_are_dropped(target: bytes,
                                                                   status: int) -> None:
    """CONNECT gets one answer (400 for an authority this server cannot parse, else the
    handler's), then a hang-up: what follows it is not HTTP."""
    async def test(server: Server) -> None:
        client = await Client.connect(server)
        client.send(b"CONNECT %s HTTP/1.1\r\nHost: example.com:443\r\n\r\n" % target
                    + b"\x16\x03\x01 tls bytes\r\n\r\n")
        assert (await client.response())[0] == status
        assert await client.closed()  # and nothing after the answer
    serving(echo, test)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_http2_gets_an_http11_answer() -> None:
    """`curl --http2` (h2c upgrade, with a body) gets the answer in HTTP/1.1."""
    async def test(server: Server) -> None:
        proc = await asyncio.create_subprocess_exec(
            "curl", "-s", "--http2", "-m", "10", "-w", "\n%{http_version} %{http_code}",
            "-d", '{"prompt": "hi"}', f"{server.address}/v1/completions",
            stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        assert out.decode().splitlines() == ['POST /v1/completions? - {"prompt": "hi"}', "1.1 200"]
    serving(echo, test)
