"""Routes, JSON answers and a server in a thread: every ftctl service on `httpserver`.

`httpserver.Server` takes one handler. A service (the sim, the canary daemon, the
failover status page, the fault proxy's control API, the metrics endpoints) builds a
`Router`, adds its routes and serves it; so the one server's hardening (header and
body limits, slowloris timeouts, connection and buffer caps) covers them all.

    router = Router()
    router.get("/health", health)               # async def health(request) -> Reply
    router.post("/report", report)
    server = await start_server(router, "127.0.0.1", 0)

A path may end in `/{name}` segments to capture them (`/toxics/{name}`), the last
one as `{name:path}` to take the rest of the path, slashes included: the captured
values (not percent-decoded) are in `request_params(request)`. An unknown path is 404, a known
path with another method 405 with `Allow`.

A blocking program (the failover supervisor, `ftctl gpu watch`) serves from a
thread with `BackgroundServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from dynamo_ftctl.httpserver import (
    Handler,
    Reply,
    Request,
    Server,
    Stream,
    start_server,
)

__all__ = [
    "BackgroundServer",
    "Router",
    "json_reply",
    "loop_factory",
    "metrics_reply",
    "request_json",
    "request_params",
    "text_reply",
]

_PARAMS: dict[int, dict[str, str]] = {}  # id(request) -> captured path segments


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when installed (a base dependency, not on Windows), else None (asyncio's):
    for `asyncio.Runner(loop_factory=...)`; about twice the default loop's request rate."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def metrics_reply(registry: Any) -> Reply:
    """`registry`'s Prometheus exposition (every service's `/metrics`), without the
    `<name>_created` series prometheus_client adds by default (Dynamo's and other Rust
    registries have none); prometheus_client is imported here, on the first scrape, not
    at start-up."""
    from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

    disable_created_metrics()  # type: ignore[no-untyped-call]
    return text_reply(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def json_reply(doc: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    """`doc` as a JSON answer."""
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return Reply(status, body, "application/json", headers or {})


def text_reply(text: str | bytes, status: int = 200, *,
               content_type: str = "text/plain; charset=utf-8",
               headers: Mapping[str, str] | None = None) -> Reply:
    """A plain-text (or any `content_type`) answer."""
    body = text.encode() if isinstance(text, str) else text
    return Reply(status, body, content_type, headers or {})


def request_json(request: Request) -> Any:
    """The request body as JSON (`openai.parse_request_json`: bounded depth, no NaN).

    Raises ValueError with a one-line reason for a body that is not such JSON.
    """
    from dynamo_ftctl.openai import parse_request_json

    return parse_request_json(request.body)


def request_params(request: Request) -> dict[str, str]:
    """The path segments a `{name}` route captured for `request` (empty for none)."""
    return _PARAMS.get(id(request), {})


class Router:
    """Handlers by method and path: exact paths first, then `{name}` patterns."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[tuple[str, ...], dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        """Route `method path` (a method of "*" takes any) to `handler`."""
        parts = tuple(path.strip("/").split("/"))
        if any(p.startswith("{") and p.endswith("}") for p in parts):
            for known, methods in self._patterns:
                if known == parts:
                    methods[method.upper()] = handler
                    return
            self._patterns.append((parts, {method.upper(): handler}))
        else:
            self._exact.setdefault(path, {})[method.upper()] = handler

    def get(self, path: str, handler: Handler) -> None:
        """Route GET (and HEAD: the server sends the head only) `path`."""
        self.add("GET", path, handler)
        self.add("HEAD", path, handler)

    def post(self, path: str, handler: Handler) -> None:
        self.add("POST", path, handler)

    def delete(self, path: str, handler: Handler) -> None:
        self.add("DELETE", path, handler)

    def _match(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        methods = self._exact.get(path)
        if methods is not None:
            return methods, {}
        parts = path.strip("/").split("/")
        for pattern, methods in self._patterns:
            tail = pattern[-1].endswith(":path}")
            if len(pattern) != len(parts) and not (tail and len(parts) > len(pattern)):
                continue
            segments = parts
            if tail:  # the last segment takes the rest of the path, slashes and all
                segments = [*parts[:len(pattern) - 1], "/".join(parts[len(pattern) - 1:])]
            params: dict[str, str] = {}
            for want, got in zip(pattern, segments, strict=True):
                if want.startswith("{") and want.endswith("}"):
                    if not got:
                        break
                    params[want[1:-1].removesuffix(":path")] = got
                elif want != got:
                    break
            else:
                return methods, params
        return None, {}

    async def __call__(self, request: Request) -> Reply | Stream:
        methods, params = self._match(request.path)
        if methods is None:
            return json_reply({"error": {"message": f"no route {request.path}",
                                         "type": "not_found", "code": 404}}, 404)
        handler = methods.get(request.method) or methods.get("*")
        if handler is None:
            allow = ", ".join(sorted(methods))
            return json_reply({"error": {"message": f"{request.method} not allowed here",
                                         "type": "method_not_allowed", "code": 405}},
                              405, {"Allow": allow})
        if not params:
            return await handler(request)
        _PARAMS[id(request)] = params
        try:
            return await handler(request)
        finally:
            _PARAMS.pop(id(request), None)


class BackgroundServer:
    """An `httpserver.Server` on an event loop of its own thread, for blocking programs.

    `start()` returns once it listens (its `address` is then known); `stop()` shuts it
    down within `deadline_s` and joins the thread. Handlers run on that thread's loop.
    """

    def __init__(self, handler: Handler, host: str, port: int, **server_options: Any) -> None:
        self._handler = handler
        self._host = host
        self._port = port
        self._options = server_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def address(self) -> str:
        """The bound address as a URL (after `start`)."""
        assert self._server is not None
        return self._server.address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        """Listen (raises the bind error, an OSError, in this thread)."""
        self._thread = threading.Thread(target=self._run, name="ftctl-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            msg = f"the HTTP server on {self._host}:{self._port} did not start"
            raise TimeoutError(msg)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        try:
            self._server = await start_server(self._handler, self._host, self._port,
                                              **self._options)
        except BaseException as exc:  # handed to start()'s caller
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stopped.wait()

    def stop(self, deadline_s: float = 2.0) -> None:
        """Stop accepting, finish answers within `deadline_s`, end the thread."""
        loop, server, stopped = self._loop, self._server, self._stopped
        if loop is None or server is None or stopped is None or loop.is_closed():
            return

        async def shut() -> None:
            await server.shutdown(deadline_s)
            stopped.set()

        with contextlib.suppress(RuntimeError, TimeoutError):
            asyncio.run_coroutine_threadsafe(shut(), loop).result(deadline_s + 5.0)
        if self._thread is not None:
            self._thread.join(deadline_s + 5.0)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
