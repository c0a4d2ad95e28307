"""What happened to one request, timed from its planned send time and its actual one.

Times are seconds since the start of the run on the monotonic clock. The
outcome is `ok`, `migrated` (answered, after the proxy moved the stream:
`x-ftctl-migrated` header) or one error class: `connect`, `timeout`,
`4xx_<code>`, `5xx_<code>`, `broken_stream` (cut before its finish, or an SSE
error event), `other`. A shed answer (429, 503, 529) keeps its `Retry-After`
in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "MIGRATED_HEADER",
    "SHED_STATUSES",
    "SUCCESS",
    "RequestRecord",
    "http_error_class",
    "retry_after_s",
]

MIGRATED_HEADER = "x-ftctl-migrated"
SUCCESS = frozenset({"ok", "migrated"})
# Statuses of a server shedding load, whose `Retry-After` the record keeps.
SHED_STATUSES = frozenset({429, 503, 529})


def retry_after_s(status: int, value: str | bytes | None, *,
                  wall: float | None = None) -> float | None:
    """Seconds a shed answer (429/503/529) asks to wait: `Retry-After` as delay-seconds or
    an HTTP date (relative to `wall`, the time it arrived); None otherwise or unreadable."""
    if status not in SHED_STATUSES or value is None:
        return None
    text = (value.decode("latin-1") if isinstance(value, bytes) else value).strip()
    if text.isdigit():
        return float(text)
    try:
        seconds = float(text)
    except ValueError:
        import email.utils
        import time

        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if wall is None else wall)
        return max(0.0, seconds)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def http_error_class(status: int) -> str:
    """The error class of an HTTP status: `4xx_429`, `5xx_503`, ..."""
    return f"{status // 100}xx_{status}"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request: its timeline, tokens and outcome."""

    index: int
    target: str
    planned: float
    sent: float
    done: float
    first_token: float | None
    output_tokens: int
    itl: tuple[float, ...]
    status: int | None
    outcome: str
    migrated: int = 0
    warmup: bool = False
    error: str | None = None
    # TTFT as the server itself measured it, when it says (`ftctl sim`'s
    # `ftctl_server_ttft_ms` in a stream's finishing chunk), in seconds.
    server_ttft: float | None = None
    # What a shed answer (429, 503, 529) asked: `Retry-After`, in seconds.
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        """True when the request was answered in full (migrated or not)."""
        return self.outcome in SUCCESS

    @property
    def queue_s(self) -> float:
        """Planned → sent: schedule lag plus time waiting for a concurrency slot."""
        return self.sent - self.planned

    @property
    def ttft_s(self) -> float | None:
        """Time to first token from the planned send time."""
        return None if self.first_token is None else self.first_token - self.planned

    @property
    def ttft_from_sent_s(self) -> float | None:
        """Time to first token from the actual send time."""
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e_s(self) -> float:
        """End-to-end latency from the planned send time."""
        return self.done - self.planned

    @property
    def e2e_from_sent_s(self) -> float:
        """End-to-end latency from the actual send time."""
        return self.done - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (streamed answers only)."""
        if self.first_token is None or self.output_tokens < 2 or not self.itl:
            return None
        return (self.done - self.first_token) / (self.output_tokens - 1)
