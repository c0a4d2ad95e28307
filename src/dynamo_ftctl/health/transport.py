"""The HTTP seam of canary probes: one POST of a JSON body, bounded in time and size.

Two implementations share one contract (`HttpReply` or a `TransportError`):

- `HttpClientTransport`: the standard library's `http.client`, for the one-shot
  probe. Importing httpx costs ~60 ms of a probe's ~150 ms budget (measured on
  this host: `python -c 'import httpx'` 183 ms vs `import http.client` 68 ms);
  one POST needs no connection pool.
- `AiohttpTransport`: one shared `aiohttp.ClientSession` for the daemon's
  fan-out to many workers (DESIGN.md: httpx slows down as its pool grows).

Both stop at `max_bytes` and at an overall deadline, so a 10 MB body or an SSE
stream that never ends costs at most the timeout. A timeout before any response
header is `timeout` (the worker is unreachable); a body still flowing at the
deadline is `endless_body` (the worker answered, wrongly).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, Protocol
from urllib.parse import urlsplit

import msgspec

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "MAX_BODY_BYTES",
    "AiohttpTransport",
    "AsyncTransport",
    "FailureKind",
    "HttpClientTransport",
    "HttpReply",
    "SyncTransport",
    "TransportError",
]

# A canary answer is a few KiB; 1 MiB leaves room for long prompts echoed back as ids.
MAX_BODY_BYTES = 1024 * 1024

FailureKind = Literal["refused", "timeout", "reset", "too_large", "endless_body", "protocol"]


class HttpReply(msgspec.Struct, frozen=True):
    """A complete HTTP response."""

    status: int
    body: bytes
    content_type: str


class TransportError(Exception):
    """The exchange failed before a complete response; `transient` ones may be retried."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    @property
    def transient(self) -> bool:
        """A connection reset mid-exchange may pass; refusals and timeouts are verdicts."""
        return self.kind == "reset"

    @property
    def unreachable(self) -> bool:
        """No answer at all (as opposed to a wrong or unbounded one)."""
        return self.kind in ("refused", "timeout", "reset")


class SyncTransport(Protocol):
    """Blocking POST of a JSON body."""

    def post_json(self, url: str, body: bytes, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> HttpReply:
        """POST `body` to `url`; `TransportError` when no complete response came."""
        ...


class AsyncTransport(Protocol):
    """Non-blocking POST of a JSON body."""

    async def post_json(self, url: str, body: bytes, *, timeout_s: float,
                        headers: Mapping[str, str] | None = None) -> HttpReply:
        """POST `body` to `url`; `TransportError` when no complete response came."""
        ...


def _too_large(received: int, limit: int) -> TransportError:
    return TransportError("too_large", f"response body over {limit:,} bytes "
                                       f"({received:,} received); the limit is {limit:,}")


def _endless(received: int, timeout_s: float, content_type: str) -> TransportError:
    return TransportError("endless_body", f"response body did not end within {timeout_s:g} s "
                                          f"({received:,} bytes of {content_type or 'no type'})")


class HttpClientTransport:
    """`http.client`, one connection per call (the one-shot probe)."""

    def __init__(self, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_bytes = max_bytes

    def post_json(self, url: str, body: bytes, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> HttpReply:
        import http.client

        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(host, parts.port, timeout=timeout_s)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        deadline = time.monotonic() + timeout_s
        got_headers = False
        content_type = ""
        received = bytearray()
        try:
            all_headers = {"Content-Type": "application/json", "Accept": "application/json",
                           "Connection": "close", **(headers or {})}
            conn.request("POST", path, body=body, headers=all_headers)
            _settimeout(conn, deadline)
            response = conn.getresponse()
            got_headers = True
            content_type = response.getheader("Content-Type", "") or ""
            while True:
                _settimeout(conn, deadline)
                chunk = response.read1(65536)
                if not chunk:
                    break
                received += chunk
                if len(received) > self.max_bytes:
                    raise _too_large(len(received), self.max_bytes)
            return HttpReply(response.status, bytes(received), content_type)
        except TransportError:
            raise
        except ConnectionRefusedError:
            raise TransportError("refused", f"connection refused by {parts.netloc}") from None
        except TimeoutError:  # socket.timeout is TimeoutError since 3.10
            if got_headers and received:
                raise _endless(len(received), timeout_s, content_type) from None
            what = "response body" if got_headers else "response"
            raise TransportError("timeout", f"no {what} within {timeout_s:g} s") from None
        except (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead) as exc:
            raise TransportError("reset", f"connection lost: {exc.__class__.__name__}") from None
        except http.client.HTTPException as exc:
            raise TransportError("protocol", f"not an HTTP response ({exc.__class__.__name__})") \
                from None
        except OSError as exc:
            raise TransportError("refused", f"cannot connect to {parts.netloc}: "
                                            f"{exc.strerror or exc}") from None
        finally:
            conn.close()


def _settimeout(conn: object, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    sock = getattr(conn, "sock", None)
    if sock is not None:
        sock.settimeout(remaining)


class AiohttpTransport:
    """One shared `aiohttp.ClientSession` (the daemon); call `close` when done."""

    def __init__(self, *, concurrency: int = 256, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_bytes = max_bytes
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._concurrency, limit_per_host=0,
                                             ttl_dns_cache=300, enable_cleanup_closed=False)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        return self._session

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared session (transition actions use it too)."""
        return self._client()

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post_json(self, url: str, body: bytes, *, timeout_s: float,
                        headers: Mapping[str, str] | None = None) -> HttpReply:
        import asyncio  # the async transport only: the one-shot probe never imports it

        import aiohttp

        session = self._client()
        state: dict[str, object] = {"headers": False, "received": 0, "type": ""}
        all_headers = {"Content-Type": "application/json", "Accept": "application/json",
                       **(headers or {})}
        try:
            async with asyncio.timeout(timeout_s):
                return await self._exchange(session, url, body, all_headers, state)
        except TransportError:
            raise
        except TimeoutError:
            received = int(state["received"])  # type: ignore[call-overload]
            if state["headers"] and received:
                raise _endless(received, timeout_s, str(state["type"])) from None
            what = "response body" if state["headers"] else "response"
            raise TransportError("timeout", f"no {what} within {timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise TransportError("refused", f"cannot connect to {urlsplit(url).netloc}: "
                                            f"{exc.strerror or exc}") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                aiohttp.ClientOSError) as exc:
            raise TransportError("reset", f"connection lost: {exc.__class__.__name__}") from None
        except aiohttp.ClientResponseError as exc:
            raise TransportError("protocol", f"not an HTTP response ({exc.message})") from None
        except aiohttp.ClientError as exc:
            raise TransportError("protocol", f"HTTP client error: {exc.__class__.__name__}") \
                from None

    async def _exchange(self, session: aiohttp.ClientSession, url: str, body: bytes,
                        headers: Mapping[str, str], state: dict[str, object]) -> HttpReply:
        async with session.post(url, data=body, headers=headers) as response:
            state["headers"] = True
            content_type = response.headers.get("Content-Type", "")
            state["type"] = content_type
            received = bytearray()
            async for chunk in response.content.iter_any():
                received += chunk
                state["received"] = len(received)
                if len(received) > self.max_bytes:
                    raise _too_large(len(received), self.max_bytes)
            return HttpReply(response.status, bytes(received), content_type)
