"""`ftctl proxy` as a process under clients that hold memory and connections: its caps."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from tests.integration.proxy.test_proxy_process import proxy_factory
from tests.integration.proxy.test_proxy_sim import ProxyFactory, wait_until

pytestmark = pytest.mark.integration

__all__ = ["proxy_factory"]  # the fixture

NOWHERE = "http://127.0.0.1:9"  # no worker is needed: no request gets that far
MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    """The resident memory of process `pid`, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_partial_bodies_cannot_grow_the_proxy_past_its_buffer_cap(
        proxy_factory: ProxyFactory) -> None:
    """30 clients each sending 14 MiB of a body they never finish (issue 22: 140 -> 540 MB,
    kept) grow the proxy by about its 32 MiB cap; the refused get 503; the memory is
    given back when they hang up."""
    proxy = proxy_factory([("w1", NOWHERE)], max_buffered_mib=32)
    pid = proxy.proc.pid
    start = rss_mib(pid)
    piece = b"x" * (14 * MIB)
    clients: list[socket.socket] = []
    refused = 0
    peak = start
    try:
        for _ in range(30):
            sock = socket.create_connection(("127.0.0.1", _port(proxy.url)), timeout=10)
            clients.append(sock)
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: %d\r\n\r\n" % (15 * MIB))
                sock.sendall(piece)
            except OSError:
                pass  # refused mid-body: the proxy said 503 and hung up
            peak = max(peak, rss_mib(pid))
        for sock in clients:
            sock.settimeout(0.2)
            # A held one times out: its body is buffered, waiting for the rest.
            with contextlib.suppress(TimeoutError):
                refused += sock.recv(64).startswith(b"HTTP/1.1 503")
        peak = max(peak, rss_mib(pid))
        assert refused >= 27  # two bodies fit under 32 MiB; the third would not
        assert peak - start < 80, (start, peak)
    finally:
        for sock in clients:
            sock.close()
    wait_until(lambda: rss_mib(pid) < start + 24, 10, "memory given back")
    assert proxy.proc.poll() is None


def test_connections_over_max_connections_get_503(proxy_factory: ProxyFactory) -> None:
    """proxy.max_connections: with that many clients connected, one more gets 503 and
    Retry-After, and /health is answered again once one leaves."""
    proxy = proxy_factory([("w1", NOWHERE)], max_connections=2)
    port = _port(proxy.url)
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        def answer_to_one_more() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                try:
                    return sock.recv(4096)
                except ConnectionResetError:
                    return b""

        first = answer_to_one_more()
        assert first.startswith(b"HTTP/1.1 503"), first
        assert b"retry-after: 1" in first
        held.pop().close()
        wait_until(lambda: answer_to_one_more().startswith(b"HTTP/1.1 200"), 10,
                   "a freed slot serves /health")
    finally:
        for sock in held:
            sock.close()
