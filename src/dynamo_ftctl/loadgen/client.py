"""Send one request with aiohttp and time it token by token.

aiohttp, not httpx, carries this hot path: on this machine one core drives
about 10-20x more requests/s through aiohttp (benchmarks/http_clients.py).
Low-level exceptions become the record's error class here, once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.loadgen.record import MIGRATED_HEADER, RequestRecord, http_error_class
from dynamo_ftctl.loadgen.workload import RequestSpec

if TYPE_CHECKING:
    import aiohttp

__all__ = ["AiohttpSender", "classify_exception"]


def classify_exception(exc: BaseException, *, got_headers: bool) -> str:
    """The error class of a client exception (connect, timeout, broken_stream, other)."""
    import aiohttp

    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientOSError | ConnectionError):
        return "broken_stream" if got_headers else "connect"
    return "other"


def _chunk_text(doc: dict[str, Any]) -> tuple[bool, bool]:
    """(carries text, carries a finish reason) for one streamed chunk."""
    choices = doc.get("choices") or ()
    text = False
    finished = False
    for choice in choices:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            text = True
        if choice.get("finish_reason"):
            finished = True
    return text, finished


class AiohttpSender:
    """Sends `RequestSpec`s over one shared aiohttp session; returns `RequestRecord`s."""

    def __init__(self, session: aiohttp.ClientSession, *, timeout_s: float,
                 now: Callable[[], float]) -> None:
        import aiohttp

        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._now = now

    async def send(self, spec: RequestSpec, planned: float, *, warmup: bool,
                   t0: float) -> RequestRecord:
        """Send `spec` now; `planned` is its planned offset from `t0`, the run's start."""
        now = self._now
        sent = now() - t0
        status: int | None = None
        first: float | None = None
        stamps: list[float] = []
        usage_tokens: int | None = None
        migrated = 0
        got_headers = False
        outcome = "ok"
        error: str | None = None
        try:
            async with self._session.post(spec.url, data=spec.body, headers=spec.headers,
                                          timeout=self._timeout) as resp:
                got_headers = True
                status = resp.status
                hops = resp.headers.get(MIGRATED_HEADER)
                if hops:
                    migrated = int(hops) if hops.isdigit() else 1
                if status >= 400:
                    await resp.read()
                    outcome = http_error_class(status)
                    error = f"HTTP {status}"
                elif "text/event-stream" in resp.headers.get("content-type", ""):
                    outcome, error, usage_tokens = await self._read_stream(resp, stamps)
                else:
                    raw = await resp.read()
                    stamps.append(now())
                    usage_tokens, error = _parse_body(raw)
                    if error is not None:
                        outcome = "other"
        except Exception as exc:  # every failure is a measured outcome, never a crash
            outcome = classify_exception(exc, got_headers=got_headers)
            error = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        done = now() - t0
        if stamps:
            first = stamps[0] - t0
        if outcome == "ok" and migrated:
            outcome = "migrated"
        tokens = usage_tokens if usage_tokens is not None else len(stamps)
        itl = tuple(b - a for a, b in itertools.pairwise(stamps))
        return RequestRecord(
            index=spec.index, target=spec.target, planned=planned, sent=sent, done=done,
            first_token=first, output_tokens=tokens, itl=itl, status=status,
            outcome=outcome, migrated=migrated, warmup=warmup, error=error,
        )

    async def _read_stream(self, resp: aiohttp.ClientResponse,
                           stamps: list[float]) -> tuple[str, str | None, int | None]:
        """Read SSE events, stamping each one that carries text."""
        now = self._now
        finished = False
        usage_tokens: int | None = None
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            stamp = now()
            try:
                doc = json.loads(data)
            except ValueError:
                return "broken_stream", "malformed SSE data", usage_tokens
            if not isinstance(doc, dict):
                continue
            if "error" in doc:
                message = doc["error"]
                if isinstance(message, dict):
                    message = message.get("message", message)
                return "broken_stream", f"SSE error event: {message}", usage_tokens
            text, fin = _chunk_text(doc)
            if text:
                stamps.append(stamp)
            finished = finished or fin
            usage = doc.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
        if not finished:
            return "broken_stream", "stream ended before a finish reason", usage_tokens
        return "ok", None, usage_tokens


def _parse_body(raw: bytes) -> tuple[int | None, str | None]:
    """(completion tokens from usage, error) of a non-streamed answer."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None, "response is not JSON"
    if not isinstance(doc, dict) or not doc.get("choices"):
        return None, "response has no choices"
    usage = doc.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"]), None
    return None, None
