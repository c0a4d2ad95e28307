"""Send one request with aiohttp and time it token by token.

aiohttp, not httpx, carries this hot path: on this machine one core drives
about 10-20x more requests/s through aiohttp (benchmarks/http_clients.py).
Low-level exceptions become the record's error class here, once. SSE framing
and field extraction are `dynamo_ftctl.openai`'s, shared with proxy and canary.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.loadgen.record import MIGRATED_HEADER, RequestRecord, http_error_class
from dynamo_ftctl.loadgen.workload import RequestSpec
from dynamo_ftctl.openai import (
    SseDecoder,
    SseEvent,
    extract_finish_reason,
    extract_text,
    extract_usage,
    parse_error_body,
)

if TYPE_CHECKING:
    import aiohttp

__all__ = ["SERVER_TTFT_FIELD", "AiohttpSender", "classify_exception"]

# `ftctl sim` reports its own TTFT of a stream in the finishing chunk (ms); the
# load generator keeps it beside its own to show what the client adds.
SERVER_TTFT_FIELD = "ftctl_server_ttft_ms"


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
        server_ttft: float | None = None
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
                    outcome, error, usage_tokens, server_ttft = await self._read_stream(
                        resp, stamps)
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
            server_ttft=server_ttft,
        )

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, stamps: list[float],
    ) -> tuple[str, str | None, int | None, float | None]:
        """Read SSE events, stamping each one that carries text when its bytes arrived."""
        now = self._now
        decoder = SseDecoder()
        state = _StreamState()
        async for chunk in resp.content.iter_any():
            stamp = now()
            for event in decoder.feed(chunk):
                if state.take(event, stamp, stamps):
                    return state.verdict()
        for event in decoder.flush():
            if state.take(event, now(), stamps):
                break
        return state.verdict()


class _StreamState:
    """What a stream said so far: finish reason, usage, or an error."""

    __slots__ = ("done", "error", "finished", "server_ttft", "usage_tokens")

    def __init__(self) -> None:
        self.finished = False
        self.done = False
        self.error: str | None = None
        self.usage_tokens: int | None = None
        self.server_ttft: float | None = None

    def take(self, event: SseEvent, stamp: float, stamps: list[float]) -> bool:
        """Fold in one event; True when the stream is over (`[DONE]` or an error)."""
        if event.is_done:
            self.done = True
            return True
        try:
            doc = json.loads(event.data)
        except ValueError:
            self.error = "malformed SSE data"
            return True
        if not isinstance(doc, dict):
            return False
        # The fast path of a plain chunk whose first choice is choice 0 (nearly every
        # event): what the `extract_*` helpers below find, without their generality
        # (ABC isinstance checks, scans) that cost a third of a streamed token's CPU.
        # JSON objects decode to dicts, so `type(...) is dict` is the same check.
        choices = doc.get("choices")
        if ("error" not in doc and doc.get("object") != "error" and type(choices) is list
                and choices and type(choice := choices[0]) is dict
                and choice.get("index", 0) == 0):
            text = choice.get("text")
            if type(text) is not str:
                text = ""
                for key in ("delta", "message"):
                    part = choice.get(key)
                    if type(part) is dict and type(content := part.get("content")) is str:
                        text = content
                        break
            if text:
                stamps.append(stamp)
            reason = choice.get("finish_reason")
            if type(reason) is str and reason:
                self._finish(doc)
            if doc.get("usage") is not None:
                self._usage(doc)
            return False
        return self._take_slow(doc, stamp, stamps)

    def _finish(self, doc: dict[str, Any]) -> None:
        self.finished = True
        server_ms = doc.get(SERVER_TTFT_FIELD)
        if isinstance(server_ms, int | float) and not isinstance(server_ms, bool):
            self.server_ttft = server_ms / 1000.0

    def _usage(self, doc: dict[str, Any]) -> None:
        usage = extract_usage(doc)
        if usage is not None and usage.completion_tokens:
            self.usage_tokens = usage.completion_tokens

    def _take_slow(self, doc: dict[str, Any], stamp: float, stamps: list[float]) -> bool:
        """Any other event, through the shared `dynamo_ftctl.openai` helpers."""
        api_error = parse_error_body(doc)
        if api_error is not None:
            self.error = f"SSE error event: {api_error}"
            return True
        if extract_text(doc):
            stamps.append(stamp)
        if extract_finish_reason(doc):
            self._finish(doc)
        self._usage(doc)
        return False

    def verdict(self) -> tuple[str, str | None, int | None, float | None]:
        if self.error is not None:
            return "broken_stream", self.error, self.usage_tokens, self.server_ttft
        if not self.finished:
            return ("broken_stream", "stream ended before a finish reason", self.usage_tokens,
                    self.server_ttft)
        return "ok", None, self.usage_tokens, self.server_ttft


def _parse_body(raw: bytes) -> tuple[int | None, str | None]:
    """(completion tokens from usage, error) of a non-streamed answer."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None, "response is not JSON"
    if not isinstance(doc, dict) or not doc.get("choices"):
        return None, "response has no choices"
    usage = extract_usage(doc)
    return (usage.completion_tokens if usage is not None else None), None
