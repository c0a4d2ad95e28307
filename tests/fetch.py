"""The project's own client for tests that call a real loopback server: one blocking
exchange through `http1.BlockingClient`, in httpx's shape (`get`, `post`, `request`)."""

from __future__ import annotations

import json as _json
from typing import Any

from dynamo_ftctl.http1 import BlockingClient, Reply, Request

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


class Session:
    """Awaited exchanges against one base URL through an `http1.Client` (aiohttp's
    `ClientSession` shape, answers as `http1.Reply`); `async with` closes it."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None,
                 timeout: float = 5.0) -> None:
        from dynamo_ftctl.http1 import Client

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

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()
