"""The project's own client for tests that call a real loopback server: one blocking
exchange through `http1.BlockingClient`, in httpx's shape (`get`, `post`, `request`);
a streamed answer read as it comes (`stream`, blocking; `Session.stream`, awaited)."""

from __future__ import annotations

import asyncio
import contextlib
import json as _json
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from dynamo_ftctl.http1 import BlockingClient, Client, Reply, Request

_CLIENT = BlockingClient(user_agent="ftctl-tests")


def request(method: str, url: str, *, json: Any = None, content: bytes = b"",
            headers: dict[str, str] | None = None, timeout: float = 5.0) -> Reply:
    """One exchange: `json` sent as a JSON body (else `content`); raises http1's errors."""
    sent = dict(headers or {})
    if json is not None:
        content = _json.dumps(json).encode()
        sent.setdefault("Content-Type", "application/json")
    return _CLIENT.handle_request(Request(method, url, content, sent, timeout))


def get(url: str, **kwargs: Any) -> Reply:
    """`request("GET", url, ...)`."""
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> Reply:
    """`request("POST", url, ...)`."""
    return request("POST", url, **kwargs)


def _encode(json: Any, content: bytes, headers: dict[str, str]) -> bytes:
    if json is not None:
        headers.setdefault("Content-Type", "application/json")
        return _json.dumps(json).encode()
    return content


class _Lines:
    """Body pieces in, whole lines out (without their line ends); `end` gives the last."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, piece: bytes) -> list[str]:
        *whole, self._pending = (self._pending + piece).split(b"\n")
        return [line.rstrip(b"\r").decode() for line in whole]

    def end(self) -> list[str]:
        return [self._pending.decode()] if self._pending else []


def _lines(pieces: Iterator[bytes]) -> Iterator[str]:
    lines = _Lines()
    for piece in pieces:
        yield from lines.feed(piece)
    yield from lines.end()


class Streamed:
    """A streamed answer being read: `status`, `headers` (names in lower case), and its
    body piece by piece (`iter_bytes`), line by line (`iter_lines`) or whole (`read`)."""

    def __init__(self, status: int, headers: dict[str, str],
                 pieces: queue.Queue[tuple[str, Any]], timeout: float) -> None:
        self.status = status
        self.headers = headers
        self._pieces = pieces
        self._timeout = timeout
        self._ended = False

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def iter_bytes(self) -> Iterator[bytes]:
        """The body's pieces as they arrive; raises the connection's error, or
        `TimeoutError` when no piece comes within the stream's timeout."""
        while not self._ended:
            try:
                kind, value = self._pieces.get(timeout=self._timeout + 5)
            except queue.Empty:
                raise TimeoutError(f"no body piece in {self._timeout + 5:.0f} s") from None
            if kind == "data":
                yield value
            elif kind == "end":
                self._ended = True
            else:
                self._ended = True
                raise value

    def iter_lines(self) -> Iterator[str]:
        """The body's lines, without their line ends."""
        return _lines(self.iter_bytes())

    def read(self) -> bytes:
        """The rest of the body."""
        return b"".join(self.iter_bytes())


@contextlib.contextmanager
def stream(method: str, url: str, *, json: Any = None, content: bytes = b"",
           headers: dict[str, str] | None = None, timeout: float = 5.0) -> Iterator[Streamed]:
    """A request whose answer is read as it arrives (httpx's `stream`): an `http1.Client`
    on an event loop in a thread of its own; leaving the block closes the connection."""
    sent = dict(headers or {})
    body = _encode(json, content, sent)
    pieces: queue.Queue[tuple[str, Any]] = queue.Queue()
    loop = asyncio.new_event_loop()
    tasks: list[asyncio.Task[None]] = []

    async def pump() -> None:
        client = Client(user_agent="ftctl-tests")
        try:
            resp = await client.request(method, url, body, sent, connect_timeout_s=timeout,
                                        head_timeout_s=timeout)
            with contextlib.closing(resp):
                head = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in resp.headers.items()}
                pieces.put(("head", (resp.status or 0, head)))
                while chunk := await resp.next_chunk(timeout):
                    pieces.put(("data", chunk))
                pieces.put(("end", None))
        except Exception as exc:  # handed to the reading thread
            pieces.put(("error", exc))
        finally:
            await client.close()

    def run() -> None:
        tasks.append(loop.create_task(pump()))
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(tasks[0])
        loop.close()

    thread = threading.Thread(target=run, name="ftctl-tests-stream", daemon=True)
    thread.start()
    try:
        try:
            kind, value = pieces.get(timeout=timeout + 5)
        except queue.Empty:
            raise TimeoutError(f"no answer from {url} in {timeout + 5:.0f} s") from None
        if kind != "head":
            raise value
        status, head = value
        yield Streamed(status, head, pieces, timeout)
    finally:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the pump ended
            loop.call_soon_threadsafe(lambda: [task.cancel() for task in tasks])
        thread.join(timeout + 5)


class AsyncStreamed:
    """`Streamed` for awaited code: `status`, `headers`, `aiter_bytes`, `aiter_lines`, `aread`."""

    def __init__(self, status: int, headers: dict[str, str], response: Any,
                 timeout: float) -> None:
        self.status = status
        self.headers = headers
        self._response = response
        self._timeout = timeout

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while chunk := await self._response.next_chunk(self._timeout):
            yield chunk

    async def aiter_lines(self) -> AsyncIterator[str]:
        lines = _Lines()
        async for piece in self.aiter_bytes():
            for line in lines.feed(piece):
                yield line
        for line in lines.end():
            yield line

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])


class Session:
    """Awaited exchanges against one base URL through an `http1.Client` (aiohttp's
    `ClientSession` shape, answers as `http1.Reply`); `async with` closes it."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None,
                 timeout: float = 5.0) -> None:

        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout
        self._client = Client(user_agent="ftctl-tests")

    async def request(self, method: str, path: str, *, json: Any = None, content: bytes = b"",
                      headers: dict[str, str] | None = None,
                      params: dict[str, str] | None = None) -> Reply:
        """One exchange: `path` (with `params` as its query) under the base URL."""
        from urllib.parse import urlencode

        sent = {**self.headers, **(headers or {})}
        if json is not None:
            content = _json.dumps(json).encode()
            sent.setdefault("Content-Type", "application/json")
        url = self.base_url + path + (f"?{urlencode(params)}" if params else "")
        return await self._client.handle_async_request(
            Request(method, url, content, sent, self.timeout))

    async def get(self, path: str, **kwargs: Any) -> Reply:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> Reply:
        return await self.request("POST", path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> Reply:
        return await self.request("DELETE", path, **kwargs)

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, *, json: Any = None, content: bytes = b"",
                     headers: dict[str, str] | None = None) -> AsyncIterator[AsyncStreamed]:
        """A request whose answer is read as it arrives; leaving closes the connection."""
        sent = {**self.headers, **(headers or {})}
        body = _encode(json, content, sent)
        resp = await self._client.request(method, self.base_url + path, body, sent,
                                          connect_timeout_s=self.timeout,
                                          head_timeout_s=self.timeout)
        with contextlib.closing(resp):
            head = {k.decode("latin-1").lower(): v.decode("latin-1")
                    for k, v in resp.headers.items()}
            yield AsyncStreamed(resp.status or 0, head, resp, self.timeout)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()
