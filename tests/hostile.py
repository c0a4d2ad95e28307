"""What an attacker or a careless client sends a server's front door, as hypothesis
strategies, and the raw-socket exchange the fuzz tests judge the answer by."""

from __future__ import annotations

import json
import socket
from typing import Any

from hypothesis import strategies as st

# Any JSON value, NaN and Infinity included (json.dumps writes them; strict JSON has none).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=16,
)
_SMALL = st.integers(-2, 24)


def request_bodies(model: str) -> st.SearchStrategy[Any]:
    """Completion and chat bodies: the known fields with likely and unlikely values, or
    any JSON at all."""
    fields = {
        "model": st.just(model) | JSON,
        "prompt": st.text(max_size=40) | st.lists(st.integers(0, 300), max_size=8) | JSON,
        "messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
            "content": st.text(max_size=20) | JSON}), max_size=3) | JSON,
        "max_tokens": _SMALL | JSON,
        "max_completion_tokens": _SMALL | JSON,
        "stream": st.booleans() | JSON,
        "temperature": st.floats(0, 2) | JSON,
        "top_p": st.floats(0, 1) | JSON,
        "seed": st.integers(0, 2**31) | JSON,
        "n": st.integers(0, 3) | JSON,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2) | JSON,
        "logprobs": st.integers(0, 5) | st.booleans() | JSON,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
        "return_token_ids": st.booleans() | JSON,
        "continue_final_message": st.booleans() | JSON,
    }
    return st.fixed_dictionaries({}, optional=fields) | JSON


def request_payloads(model: str) -> st.SearchStrategy[bytes]:
    """Request bodies as bytes: JSON bodies (`request_bodies`, NaN and Infinity as json
    writes them), arrays and objects nested up to 100,000 deep, or any bytes."""
    nested = st.integers(1, 100_000).flatmap(lambda depth: st.sampled_from([
        b"[" * depth, b"[" * depth + b"]" * depth,
        b'{"prompt": ' * depth + b'"x"' + b"}" * depth]))
    return (request_bodies(model).map(lambda doc: json.dumps(doc).encode())
            | nested | st.binary(max_size=200))


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    """One POST of `body` (any bytes) with Content-Length, closing after the answer."""
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (path.encode(), extra, len(body), body))


_METHODS = st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS", b"CONNECT", b"PRI",
                            b"G\x00T", b""])
_PATHS = st.sampled_from([b"/v1/completions", b"/v1/chat/completions", b"/health", b"/metrics",
                          b"/v1/models", b"/busy_threshold", b"*", b"http://x/y", b"/%00"]) \
    | st.binary(max_size=20)
_HEADERS = st.lists(st.tuples(
    st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Upgrade", b"Connection",
                     b"Expect", b"Host", b"x-ftctl-priority", b"X-Request-Id", b"HTTP2-Settings",
                     b"Authorization"]) | st.binary(max_size=10),
    st.sampled_from([b"0", b"5", b"-1", b"99999999999", b"chunked", b"h2c", b"websocket",
                     b"Upgrade, HTTP2-Settings", b"close", b"keep-alive", b"100-continue",
                     b"premium", b"Bearer x"]) | st.binary(max_size=20)), max_size=5)

# Bytes at a socket: anything, or something shaped like an HTTP/1.1 request (a request
# line, odd headers, a body), to get past the first byte of the parser.
RAW_REQUESTS = st.binary(max_size=300) | st.builds(
    lambda method, path, version, headers, body: (
        method + b" " + path + b" " + version + b"\r\n"
        + b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        + b"\r\n" + body),
    _METHODS, _PATHS, st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x"]),
    _HEADERS, st.binary(max_size=100) | JSON.map(lambda doc: json.dumps(doc).encode()))


def exchange(port: int, data: bytes, *, half_close: bool = False,
             timeout_s: float = 20.0) -> bytes:
    """Send `data` and read the answer until the server hangs up. `half_close`: say
    that is all (the server takes it as the client leaving, so a request left
    half-sent is not waited for, and a whole one may go unanswered)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered early (413, 431) and hung up: read what it said
        out = b""
        while True:
            try:
                piece = sock.recv(65536)
            except ConnectionResetError:
                return out
            if not piece:
                return out
            out += piece


def status_of(answer: bytes) -> int | None:
    """The status of the first response in `answer` (None: no response)."""
    if not answer.startswith(b"HTTP/1."):
        assert answer == b"", answer[:200]
        return None
    return int(answer.split(b" ", 2)[1])


def assert_answered_sanely(answer: bytes) -> None:
    """No 500 and no garbage: a well-formed status line, or nothing at all (a request the
    client left half-sent)."""
    status = status_of(answer)
    assert status is None or (100 <= status < 600 and status != 500), answer[:300]


def assert_alive(port: int) -> None:
    """The server still answers its health check."""
    answer = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(answer) == 200, answer[:300]
