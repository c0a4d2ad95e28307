"""`ftctl proxy` as a process: signals, graceful shutdown and IPv6, over a scripted worker."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from tests import fetch
from tests.integration.proxy.test_proxy_sim import (
    MODEL,
    ProxyFactory,
    proxy_factory,
    threaded_server,
)

pytestmark = pytest.mark.integration

__all__ = ["proxy_factory"]  # the fixture, shared with the sim-worker tests

TOKENS = 10
TOKEN_S = 0.05  # the scripted worker's decode pace: a stream lasts ~0.5 s


@contextmanager
def paced_worker() -> Iterator[str]:
    """A worker streaming TOKENS tokens at TOKEN_S each (stdlib server, port 0)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (json.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]})
                    if self.path == "/v1/models" else "vllm:num_requests_waiting 0\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = list(request["prompt"].encode())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(TOKENS):
                choice: dict[str, Any] = {
                    "index": 0, "text": "a", "token_ids": [97],
                    "finish_reason": "length" if i == TOKENS - 1 else None}
                if i == 0:
                    choice["prompt_token_ids"] = prompt
                event = {"id": "x", "object": "text_completion", "model": MODEL,
                         "choices": [choice]}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(TOKEN_S)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:
            pass

    with threaded_server(Handler) as url:
        yield url


BODY = {"model": MODEL, "prompt": "hello", "max_tokens": TOKENS, "stream": True,
        "temperature": 0}


def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(
        proxy_factory: ProxyFactory) -> None:
    """SIGTERM mid-stream: the client still gets every token and [DONE]; the proxy exits 0."""
    with paced_worker() as url:
        proxy = proxy_factory([("w1", url)])
        texts: list[str] = []
        first = threading.Event()
        with fetch.stream("POST", f"{proxy.url}/v1/completions", json=BODY,
                          timeout=10) as resp:
            assert resp.status == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
                    if not first.is_set():
                        first.set()
                        proxy.proc.send_signal(signal.SIGTERM)
                elif line == "data: [DONE]":
                    texts.append("[DONE]")
        assert texts == ["a"] * TOKENS + ["[DONE]"]
        assert proxy.proc.wait(10) == 0


def test_sigint_exits_130(proxy_factory: ProxyFactory) -> None:
    """SIGINT (Ctrl-C) stops the proxy with exit code 130 and says so in one last line."""
    with paced_worker() as url:
        proxy = proxy_factory([("w1", url)])
        assert fetch.get(f"{proxy.url}/health", timeout=5).status == 200
        proxy.proc.send_signal(signal.SIGINT)
        assert proxy.proc.wait(10) == 130
        assert proxy.log_text().endswith("interrupted\n")


def test_address_in_use_exits_2_with_one_line(tmp_path: Path) -> None:
    """A listen address already taken is a one-line error naming proxy.listen, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(
            f"cluster: t\nworkers:\n  - {{name: w1, url: 'http://127.0.0.1:9', model: {MODEL}}}\n"
            f"proxy:\n  listen: 127.0.0.1:{port}\n")
        done = subprocess.run(
            [sys.executable, "-m", "dynamo_ftctl", "-i", str(inventory), "proxy"],
            capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert f"proxy.listen 127.0.0.1:{port}: cannot listen there" in done.stderr
    assert "Traceback" not in done.stderr
    assert "serving" not in done.stderr


def test_ipv6_listen_address(proxy_factory: ProxyFactory) -> None:
    """`listen: "[::1]:0"` serves on IPv6 loopback and prints the URL with brackets."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback: {exc}")
    with paced_worker() as url:
        proxy = proxy_factory([("w1", url)], listen="[::1]:0")
        assert proxy.url.startswith("http://[::1]:")
        assert fetch.get(f"{proxy.url}/health", timeout=10).json()["status"] == "ok"
        answer = fetch.post(f"{proxy.url}/v1/completions", json={**BODY, "stream": False},
                            timeout=10)
        assert answer.json()["choices"][0]["text"] == "a" * TOKENS
