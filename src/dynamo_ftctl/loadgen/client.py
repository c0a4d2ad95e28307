"""What the load generator reads from an answer, apart from the wire.

`sender.Http1Sender` (over `dynamo_ftctl.http1`) cuts SSE bodies with
`SseStream` (on the one SSE decoder, `dynamo_ftctl.sse`), folds events with
`_StreamState` (field extraction agrees with `dynamo_ftctl.openai`'s helpers,
proven by a property test) and builds records with `make_record`.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from dynamo_ftctl.jsoncodec import decode_fast, loads
from dynamo_ftctl.loadgen.record import (
    MIGRATED_HEADER,
    RequestRecord,
)
from dynamo_ftctl.loadgen.workload import RequestSpec
from dynamo_ftctl.openai import (
    extract_finish_reason,
    extract_text,
    extract_usage,
    parse_error_body,
)
from dynamo_ftctl.sse import SseDecoder, SseEvent, data_and_comments

__all__ = [
    "SERVER_TTFT_FIELD",
    "SseStream",
    "make_record",
    "migrated_hops",
    "parse_body",
]

# `ftctl sim` reports its own TTFT of a stream in the finishing chunk (ms); the
# load generator keeps it beside its own to show what the client adds.
SERVER_TTFT_FIELD = "ftctl_server_ttft_ms"


def migrated_hops(value: str | bytes | None) -> int:
    """Migrations a proxy reports in `x-ftctl-migrated` (0 when absent)."""
    if not value:
        return 0
    return int(value) if value.isdigit() else 1


def make_record(spec: RequestSpec, planned: float, *, t0: float, sent: float, done: float,
                stamps: list[float], status: int | None, outcome: str, error: str | None,
                usage_tokens: int | None, server_ttft: float | None, migrated: int,
                warmup: bool, retry_after: float | None) -> RequestRecord:
    """The record of one exchange (token stamps and `done` on the run's clock, not yet
    offset by `t0`; `sent` already is)."""
    if outcome == "ok" and migrated:
        outcome = "migrated"
    tokens = usage_tokens if usage_tokens is not None else len(stamps)
    itl = tuple(b - a for a, b in itertools.pairwise(stamps))
    return RequestRecord(
        index=spec.index, target=spec.target, planned=planned, sent=sent, done=done - t0,
        first_token=stamps[0] - t0 if stamps else None, output_tokens=tokens, itl=itl,
        status=status, outcome=outcome, migrated=migrated, warmup=warmup, error=error,
        server_ttft=server_ttft, retry_after_s=retry_after,
    )


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
        return self.take_data(event.data, stamp, stamps)

    def take_data(self, data: str | bytes, stamp: float, stamps: list[float]) -> bool:
        """Fold in the data of one event that is not `[DONE]`; True when it ends the stream."""
        try:
            doc = decode_fast(data)  # `loads`, inlined: this runs once per token
        except (msgspec.DecodeError, UnicodeDecodeError):
            try:
                doc = loads(data)
            except ValueError:
                self.error = "malformed SSE data"
                return True
        if type(doc) is not dict:
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


# `ftctl proxy` says a stream migrated after its headers left in a trailing comment.
_MIGRATED_COMMENT = MIGRATED_HEADER.encode() + b":"  # a comment line's text


class SseStream:
    """An SSE body cut into raw events by `dynamo_ftctl.sse.SseDecoder.blocks` as it
    arrives, and folded into a `_StreamState`.

    An event of one `data: ` line, nearly all of them, costs one slice before its
    JSON is decoded (no `SseEvent`, no str). Comments are read for the proxy's
    `: x-ftctl-migrated: N`.
    """

    __slots__ = ("_blocks", "_decoder", "migrated", "over", "stamps", "state")

    def __init__(self, stamps: list[float]) -> None:
        self._decoder = SseDecoder()
        self._blocks = self._decoder.blocks  # bound once: called per read of every stream
        self.stamps = stamps
        self.state = _StreamState()
        self.migrated = 0
        self.over = False

    def feed(self, chunk: bytes, stamp: float) -> bool:
        """Add bytes that arrived at `stamp`; True once the stream is over."""
        if self.over:
            return True
        for event in self._blocks(chunk):
            if self._event(event, stamp):
                self.over = True
                return True
        return False

    def end(self, stamp: float) -> tuple[str, str | None, int | None, float | None]:
        """The body ended: dispatch a last event that lacked its blank line; the verdict."""
        rest = self._decoder.rest()
        if rest and not self.over:
            self.over = self._event(rest, stamp)
        return self.state.verdict()

    def _event(self, event: bytes, stamp: float) -> bool:
        data, comments = data_and_comments(event)
        for comment in comments:
            if comment.startswith(_MIGRATED_COMMENT):
                hops = migrated_hops(comment[len(_MIGRATED_COMMENT):].strip()) or 1
                self.migrated = max(self.migrated, hops)
        if data is None:
            return False
        if len(data) < 16 and data.strip() == b"[DONE]":
            self.state.done = True
            return True
        return self.state.take_data(data, stamp, self.stamps)


def parse_body(raw: bytes) -> tuple[int | None, str | None]:
    """(completion tokens from usage, error) of a non-streamed answer."""
    try:
        doc = loads(raw)
    except ValueError:
        return None, "response is not JSON"
    if not isinstance(doc, dict) or not doc.get("choices"):
        return None, "response has no choices"
    # The common answer's `usage.completion_tokens`, read directly (`extract_usage`'s
    # generality cost a tenth of a non-streamed request's CPU).
    usage_doc = doc.get("usage")
    if type(usage_doc) is dict and type(tokens := usage_doc.get("completion_tokens")) is int:
        return tokens, None
    usage = extract_usage(doc)
    return (usage.completion_tokens if usage is not None else None), None
