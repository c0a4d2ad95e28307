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
