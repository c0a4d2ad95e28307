"""`httpapp`: routes, 404/405, captured segments, JSON answers, a server in a thread."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from dynamo_ftctl.httpapp import (
    BackgroundServer,
    Router,
    json_reply,
    request_json,
    request_params,
    text_reply,
)
from dynamo_ftctl.httpserver import Reply, Request


def _request(method: str, path: str, body: bytes = b"") -> Request:
    return Request(method, path, "", [], body)


async def _health(request: Request) -> Reply:
    return json_reply({"ok": True})


async def _toxic(request: Request) -> Reply:
    return text_reply(request_params(request)["name"])


def _router() -> Router:
    router = Router()
    router.get("/health", _health)
    router.delete("/toxics/{name}", _toxic)
    return router


def test_routes_by_method_and_path() -> None:
    router = _router()

    async def go() -> None:
        ok = await router(_request("GET", "/health"))
        assert isinstance(ok, Reply)
        assert (ok.status, json.loads(ok.body)) == (200, {"ok": True})
        missing = await router(_request("GET", "/nope"))
        assert isinstance(missing, Reply)
        assert missing.status == 404
        wrong = await router(_request("POST", "/health"))
        assert isinstance(wrong, Reply)
        assert wrong.status == 405
        assert wrong.headers["Allow"] == "GET, HEAD"
        named = await router(_request("DELETE", "/toxics/lag"))
        assert isinstance(named, Reply)
        assert named.body == b"lag"
        empty = await router(_request("DELETE", "/toxics/"))
        assert isinstance(empty, Reply)
        assert empty.status == 404
    asyncio.run(go())


def test_a_path_tail_takes_the_rest_of_the_path() -> None:
    """`{name:path}` as the last segment captures the rest, slashes included; the shorter
    pattern and a fixed segment that differs do not match."""
    async def kv(request: Request) -> Reply:
        return text_reply(request_params(request)["request_id"])

    router = Router()
    router.get("/admin/kv/{request_id:path}", kv)
    router.get("/toxics/{name}", _toxic)

    async def go() -> None:
        for path, body in [("/admin/kv/r1", b"r1"), ("/admin/kv/a/b%2Fc", b"a/b%2Fc")]:
            got = await router(_request("GET", path))
            assert isinstance(got, Reply)
            assert (got.status, got.body) == (200, body)
        for path in ["/admin/kv", "/admin/kv/", "/admin/xv/r1", "/toxics/a/b"]:
            got = await router(_request("GET", path))
            assert isinstance(got, Reply)
            assert got.status == 404, path
    asyncio.run(go())


def test_request_json_refuses_nan_and_deep_nesting() -> None:
    assert request_json(_request("POST", "/", b'{"a": 1}')) == {"a": 1}
    with pytest.raises(ValueError, match=r"NaN|JSON"):
        request_json(_request("POST", "/", b'{"a": NaN}'))
    with pytest.raises(ValueError, match="deeper"):
        request_json(_request("POST", "/", b"[" * 1000 + b"]" * 1000))


def test_background_server_serves_from_a_thread_and_stops() -> None:
    with BackgroundServer(_router(), "127.0.0.1", 0) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (200, {"ok": True})
        conn.close()
        port = server.port
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/health")


def test_background_server_raises_the_bind_error() -> None:
    with BackgroundServer(_router(), "127.0.0.1", 0) as first, \
            pytest.raises(OSError, match="in use"):
        BackgroundServer(_router(), "127.0.0.1", first.port).start()
