"""A tiny authoritative DNS server on loopback (UDP and TCP, one port) for discovery tests.

Real packets, parsed and rendered by dnspython: the resolver under test meets the wire,
truncation and TCP fallback as it would meet CoreDNS. The zone is a mapping the test
changes while the server runs (`set_a`, `set_srv`, `set_cname`), and `behaviour` makes a
name answer badly: `servfail`, `nxdomain`, `drop` (never answer: a timeout), `garbage`
(the query's id, then a header claiming 10,000 records and junk).

    with DnsServer() as dns_server:
        dns_server.set_a("vllm.test", ["127.0.0.2"])
        ...  resolver: f"127.0.0.1:{dns_server.port}"
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
from collections.abc import Iterable
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

__all__ = ["DnsServer"]

_MAX_TTL = 2**31 - 1


class DnsServer:
    """Answers from `self.zone`: {(name, type): [(rdata text, ttl), ...]}; see the module."""

    def __init__(self) -> None:
        self.zone: dict[tuple[str, str], list[str]] = {}
        self.ttl = 5
        self.behaviour: dict[str, str] = {}  # name -> servfail | nxdomain | drop | garbage
        self.queries = 0
        self.glue = True  # SRV answers carry their targets' addresses (as CoreDNS's do)
        self._lock = threading.Lock()
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []
        self.port = 0

    # ------------------------------------------------------------------ the zone

    def set_a(self, name: str, addresses: Iterable[str]) -> None:
        """`name`'s A and AAAA records: exactly `addresses` (none: NODATA, not NXDOMAIN)."""
        addresses = list(addresses)
        with self._lock:
            self.zone[(name, "A")] = [a for a in addresses if ":" not in a]
            self.zone[(name, "AAAA")] = [a for a in addresses if ":" in a]

    def set_srv(self, name: str, targets: Iterable[tuple[str, int]]) -> None:
        """`name`'s SRV records: (target, port) each, priority 0 weight 1."""
        with self._lock:
            self.zone[(name, "SRV")] = [f"0 1 {port} {target}." for target, port in targets]

    def set_cname(self, name: str, target: str) -> None:
        with self._lock:
            self.zone[(name, "CNAME")] = [f"{target}."]

    def remove(self, name: str) -> None:
        """`name` no longer exists (NXDOMAIN)."""
        with self._lock:
            for key in [k for k in self.zone if k[0] == name]:
                del self.zone[key]

    # ------------------------------------------------------------------ answering

    def _rrset(self, name: str, rdtype: str) -> dns.rrset.RRset | None:
        records = self.zone.get((name, rdtype))
        if not records:
            return None
        return dns.rrset.from_text_list(f"{name}.", self.ttl, "IN", rdtype, records)

    def answer(self, wire: bytes, limit: int) -> bytes | None:
        """The reply to one query, at most `limit` bytes (UDP: truncated with TC)."""
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # not a query: no answer
            return None
        self.queries += 1
        question = query.question[0]
        name = str(question.name).rstrip(".").lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            behaviour = self.behaviour.get(name)
            response = dns.message.make_response(query)
            response.flags |= dns.flags.AA
            if behaviour == "drop":
                return None
            if behaviour == "garbage":
                return wire[:2] + b"\x81\x80\x00\x01\x27\x10\x00\x00\x00\x00" + b"\xc0\x0c" * 40
            if behaviour == "servfail":
                response.set_rcode(dns.rcode.SERVFAIL)
                return response.to_wire()
            self._fill(response, name, rdtype)
        if behaviour == "nxdomain" or (not response.answer and not any(
                k[0] == name for k in self.zone)):
            response.set_rcode(dns.rcode.NXDOMAIN)
        return self._render(response, limit)

    def _fill(self, response: dns.message.Message, name: str, rdtype: str) -> None:
        seen: set[str] = set()
        current = name
        # CNAMEs are followed within the zone; a loop is sent as it is (each once).
        while (cname := self._rrset(current, "CNAME")) is not None and current not in seen:
            seen.add(current)
            response.answer.append(cname)
            current = str(next(iter(cname)).target).rstrip(".").lower()  # type: ignore[attr-defined]
        if current in seen:
            return
        rrset = self._rrset(current, rdtype)
        if rrset is None:
            return
        response.answer.append(rrset)
        if rdtype == "SRV":
            for rdata in rrset:
                target = str(rdata.target).rstrip(".").lower()  # type: ignore[attr-defined]
                for kind in ("A", "AAAA"):
                    glue = self._rrset(target, kind)
                    if glue is not None and self.glue:
                        response.additional.append(glue)

    @staticmethod
    def _render(response: dns.message.Message, limit: int) -> bytes:
        # A record takes at least 16 bytes on the wire: a larger answer is not rendered
        # whole first (10,000 records took seconds on a loaded machine).
        fits = sum(len(r) for r in response.answer) * 16 < limit
        if fits:
            try:
                return response.to_wire(max_size=limit)
            except dns.exception.TooBig:
                pass
        if limit < 65535:  # UDP: the client asks again over TCP
            response.answer.clear()
            response.additional.clear()
            response.flags |= dns.flags.TC
            return response.to_wire()
        # TCP: as many records as one message holds (a DNS message is at most 64 KiB).
        rrset = response.answer[-1]
        items = list(rrset)
        keep = min(len(items), limit // 16 + 1)
        while keep > 1:
            keep = keep * 9 // 10
            response.answer[-1] = dns.rrset.from_rdata_list(rrset.name, rrset.ttl, items[:keep])
            response.additional.clear()
            try:
                return response.to_wire(max_size=limit)
            except dns.exception.TooBig:
                continue
        return response.to_wire()

    # ------------------------------------------------------------------ serving

    def __enter__(self) -> DnsServer:
        server = self

        class Udp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data, sock = self.request
                reply = server.answer(data, 1232)
                if reply is not None:
                    sock.sendto(reply, self.client_address)

        class Tcp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.settimeout(5)
                try:
                    while head := _read(sock, 2):
                        data = _read(sock, struct.unpack("!H", head)[0])
                        reply = server.answer(data, 65535)
                        if reply is None:
                            return
                        sock.sendall(struct.pack("!H", len(reply)) + reply)
                except OSError:
                    return

        for _ in range(20):  # UDP on a free port, TCP on the same one (rarely taken)
            udp = socketserver.ThreadingUDPServer(("127.0.0.1", 0), Udp)
            try:
                tcp = socketserver.ThreadingTCPServer(("127.0.0.1", udp.server_address[1]), Tcp,
                                                      bind_and_activate=False)
                tcp.allow_reuse_address = True
                tcp.server_bind()
                tcp.server_activate()
            except OSError:
                udp.server_close()
                tcp.server_close()
                continue
            break
        else:
            msg = "no port free for UDP and TCP at once"
            raise OSError(msg)
        self.port = udp.server_address[1]
        for srv in (udp, tcp):
            srv.daemon_threads = True
            thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                                      daemon=True)
            thread.start()
            self._servers.append(srv)
            self._threads.append(thread)
        return self

    def __exit__(self, *_: Any) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        for thread in self._threads:
            thread.join(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            return b""
        data += piece
    return data
