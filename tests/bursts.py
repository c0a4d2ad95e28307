"""Bursts of clients around a server's stop, for the property that a stop leaves no
accepted connection open (tests/unit/httpserver/test_listener.py, the fault proxy's in
tests/integration/faults/test_netproxy.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

__all__ = ["burst_around_stop", "loop_thread", "no_unraisable"]

CLIENTS = 40
READ_DEADLINE_S = 5.0


@contextlib.contextmanager
def loop_thread() -> Iterator[Callable[[Coroutine[Any, Any, Any]], Any]]:
    """An event loop on a thread of its own; yields `call(coro)` (30 s bound)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def no_unraisable() -> Iterator[list[str]]:
    """Collects what the garbage collector could not close quietly (unclosed sockets)."""
    found: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda info: found.append(repr(info.exc_value))
    try:
        yield found
        gc.collect()
    finally:
        sys.unraisablehook = hook


def burst_around_stop(port: int, stop: Callable[[], None], rng: random.Random,
                      requests: Sequence[bytes]) -> tuple[int, list[str]]:
    """Connect CLIENTS clients, each sending one of `requests`, `stop` beginning after a
    random number of them; how many got in, and those that neither got an end nor a
    reset within the deadline."""
    go = threading.Event()

    def stop_when_told() -> None:
        go.wait(30)
        stop()

    stopping = threading.Thread(target=stop_when_told)
    stopping.start()
    stop_at = rng.randrange(1, CLIENTS - 5)
    clients: list[socket.socket] = []
    try:
        for index in range(CLIENTS):
            if index == stop_at:
                go.set()
            with contextlib.suppress(OSError):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                clients.append(sock)
                sock.sendall(rng.choice(requests))
        go.set()
        stopping.join(30)
        stuck = []
        deadline = time.monotonic() + READ_DEADLINE_S  # one for all: a bounded test
        for sock in clients:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass  # a cut is an end too
            except TimeoutError:
                stuck.append(f"client {sock.getsockname()[1]}")
        return len(clients), stuck
    finally:
        for sock in clients:
            sock.close()
