"""What a load run is: targets, schedule, workload, bounds and SLO, as frozen values.

Everything here is plain data checked on construction (`InvalidInput`, exit 2);
nothing here sends a request. `parse_duration` and `parse_length` read the
CLI's human forms (`60s`, `500ms`, `2m`; `128`, `64-256`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dynamo_ftctl.errors import InvalidInput

__all__ = [
    "DEFAULT_SPIN_S",
    "Arrival",
    "Client",
    "Length",
    "LoadConfig",
    "Schedule",
    "Shard",
    "Slo",
    "Workload",
    "parse_duration",
    "parse_length",
    "parse_shard",
    "parse_start_at",
]

Arrival = Literal["constant", "poisson", "gamma"]
# `http1` (= `auto`): `dynamo_ftctl.http1`, the package's one client, for http and
# https alike. `aiohttp` names the client it replaced: refused with a message saying so.
Client = Literal["auto", "http1", "aiohttp"]
# Busy-wait (yielding to the event loop) this long before each planned send, after
# sleeping on a timer until then; see `LoadConfig.spin_s`. 1 ms keeps the schedule
# lag's p99 well under a millisecond at a fraction of the CPU a longer spin burns
# (docs/benchmarks.md, "load.py and http_clients.py", has the figures).
DEFAULT_SPIN_S = 0.001

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "": 1.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h|)\s*$")


def parse_duration(text: str | float, *, what: str = "duration") -> float:
    """Seconds from `60`, `60s`, `500ms`, `2m`, `1h`; InvalidInput otherwise."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _DURATION.match(text)
        if not match:
            msg = f"{what}: {text!r} is not a duration (e.g. 60, 60s, 500ms, 2m, 1h)"
            raise InvalidInput(msg)
        value = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(value) or value < 0:
        msg = f"{what}: must be a finite, non-negative number of seconds"
        raise InvalidInput(msg)
    return value


@dataclass(frozen=True)
class Length:
    """A token count drawn uniformly from [low, high] (low == high: fixed)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 0 or self.high < self.low:
            msg = f"length {self.low}-{self.high}: need 0 <= low <= high"
            raise InvalidInput(msg)

    @classmethod
    def fixed(cls, n: int) -> Length:
        """Always `n` tokens."""
        return cls(n, n)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


def parse_length(text: str | int, *, what: str = "length") -> Length:
    """`128` (fixed) or `64-256` (uniform) as a `Length`."""
    if isinstance(text, int):
        return Length.fixed(text)
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        msg = f"{what}: {text!r} is not a token count (128) or range (64-256)"
        raise InvalidInput(msg)
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) else low
    try:
        return Length(low, high)
    except InvalidInput as exc:
        msg = f"{what}: {exc}"
        raise InvalidInput(msg) from None


@dataclass(frozen=True)
class Shard:
    """Share `index` of `count` of one run: every `count`-th planned arrival from `index`
    (open loop), or every `count`-th request number and a `count`-th of the users (closed
    loop). The shards of a run together send exactly what one process would."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            msg = f"shard: {self.index}/{self.count} needs 0 <= I < N"
            raise InvalidInput(msg)

    def split(self, parts: int, part: int) -> Shard:
        """Share `part` of `parts` of this shard, as a shard of the whole run."""
        return Shard(self.index + self.count * part, self.count * parts)

    def users(self, total: int) -> int:
        """This shard's closed-loop users out of `total` (the first ones take the rest)."""
        return total // self.count + (self.index < total % self.count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """`I/N` (0-based I, as Kubernetes' `JOB_COMPLETION_INDEX`) as a `Shard`."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        msg = f"--shard: {text!r} is not I/N (e.g. 0/4: the first of four shards)"
        raise InvalidInput(msg)
    try:
        return Shard(int(match.group(1)), int(match.group(2)))
    except InvalidInput as exc:
        msg = f"--shard: {exc}"
        raise InvalidInput(msg) from None


def parse_start_at(text: str) -> float:
    """A wall-clock start as epoch seconds (`1767225600.5`) or an ISO 8601 time with its
    zone (`2026-01-01T00:00:00Z`); InvalidInput otherwise."""
    import datetime as dt

    try:
        value = float(text)
    except ValueError:
        try:
            when = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            msg = (f"--start-at: {text!r} is neither epoch seconds nor an ISO 8601 time "
                   "(e.g. 2026-01-01T00:00:00Z)")
            raise InvalidInput(msg) from None
        if when.tzinfo is None:
            msg = f"--start-at: {text!r} has no time zone (machines must agree: add Z)"
            raise InvalidInput(msg) from None
        value = when.timestamp()
    if not math.isfinite(value) or value <= 0:
        msg = f"--start-at: {text!r} is not a time"
        raise InvalidInput(msg)
    return value


@dataclass(frozen=True)
class Schedule:
    """When requests start.

    Open loop (`rate` set): arrivals are planned ahead and never wait for the
    server; `arrival` picks constant gaps, Poisson, or gamma gaps whose shape is
    `burstiness` (vLLM's convention: 1 is Poisson, below 1 burstier, above 1
    more even). `ramp_to` ramps the rate linearly (or in `ramp_steps` equal
    steps) over the duration; `concurrency` caps requests in flight, and time
    spent waiting for a slot counts as latency. Closed loop (`users` set): N
    users each send their next request when the previous one ends; with
    `honor_retry_after`, a user whose request was shed (429/503/529 with a
    `Retry-After`) first waits that long, as a client does (without it, it asks
    again at once, and a shedding server gets a tight loop of refusals).
    """

    rate: float | None = None
    users: int | None = None
    arrival: Arrival = "poisson"
    burstiness: float = 1.0
    ramp_to: float | None = None
    ramp_steps: int = 0
    concurrency: int | None = None
    seed: int = 0
    honor_retry_after: bool = False

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.users is None):
            msg = "schedule: give either a rate (open loop) or a number of users (closed loop)"
            raise InvalidInput(msg)
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            msg = f"rate: must be a positive number of requests/s, got {self.rate}"
            raise InvalidInput(msg)
        if self.users is not None and self.users < 1:
            msg = f"users: must be at least 1, got {self.users}"
            raise InvalidInput(msg)
        if self.burstiness <= 0:
            msg = f"burstiness: must be positive, got {self.burstiness}"
            raise InvalidInput(msg)
        if self.ramp_to is not None and (self.rate is None or self.ramp_to <= 0):
            msg = "ramp_to: needs an open-loop rate and a positive target rate"
            raise InvalidInput(msg)
        if self.ramp_steps < 0:
            msg = "ramp_steps: must be 0 (linear) or a positive number of steps"
            raise InvalidInput(msg)
        if self.concurrency is not None and self.concurrency < 1:
            msg = f"concurrency: must be at least 1, got {self.concurrency}"
            raise InvalidInput(msg)
        if self.honor_retry_after and self.users is None:
            msg = "honor_retry_after: needs a closed loop (users); open-loop arrivals are planned"
            raise InvalidInput(msg)

    @property
    def open_loop(self) -> bool:
        """True for planned arrivals, False for N closed-loop users."""
        return self.rate is not None


@dataclass(frozen=True)
class Workload:
    """What each request asks for.

    Prompt lengths are exact token counts against `ftctl sim --tokenizer byte`
    (one ASCII byte, one token) and approximate elsewhere (the sim's default BPE
    merges a few of the random characters' pairs). `prompt_file` is
    JSONL (`{"prompt": ...}` or `{"messages": [...]}`, optional `max_tokens`);
    `trace` is the same with a `timestamp` (seconds) that replaces the schedule.

    `conversations` makes the workload multi-turn: requests go to that many
    conversations in turn, `turns` requests each, then to as many new ones. A
    conversation's turn t repeats its turns before (each user message and a reply of
    that turn's `max_tokens`, synthetic text, the server's replies are not fed back)
    and adds a user message of `prompt_tokens`: each turn's prompt extends the last
    one's, as a chat's does (chat: messages; completions: one growing prompt).
    """

    api: Literal["completions", "chat"] = "completions"
    model: str | None = None
    prompt_tokens: Length = field(default_factory=lambda: Length.fixed(32))
    max_tokens: Length = field(default_factory=lambda: Length.fixed(128))
    stream: bool = False
    ignore_eos: bool = False
    min_tokens: int | None = None
    priority: str | None = None
    prompt_file: Path | None = None
    trace: Path | None = None
    temperature: float = 0.0
    conversations: int | None = None
    turns: int = 4

    def __post_init__(self) -> None:
        if self.prompt_file is not None and self.trace is not None:
            msg = "workload: give a prompt file or a trace, not both"
            raise InvalidInput(msg)
        if self.conversations is not None:
            if self.conversations < 1:
                msg = "--conversations: must be at least 1"
                raise InvalidInput(msg)
            if self.prompt_file is not None or self.trace is not None:
                msg = "--conversations: synthetic conversations, not with a prompt file or trace"
                raise InvalidInput(msg)
        if self.turns < 1:
            msg = "--turns: must be at least 1"
            raise InvalidInput(msg)
        if self.max_tokens.low < 1:
            msg = "max_tokens: must be at least 1"
            raise InvalidInput(msg)


@dataclass(frozen=True)
class Slo:
    """Service-level objective: p99 TTFT and ITL in ms, and the largest error rate."""

    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    error_rate: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p99_ms", "itl_p99_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                msg = f"slo {name}: must be positive"
                raise InvalidInput(msg)
        if self.error_rate is not None and not 0 <= self.error_rate <= 1:
            msg = "slo error_rate: must be between 0 and 1"
            raise InvalidInput(msg)

    @property
    def empty(self) -> bool:
        """True when no objective is set."""
        return self.ttft_p99_ms is None and self.itl_p99_ms is None and self.error_rate is None


@dataclass(frozen=True)
class LoadConfig:
    """One load run: where, when, what, how long, and when to give up."""

    targets: tuple[str, ...]
    schedule: Schedule
    workload: Workload = field(default_factory=Workload)
    duration_s: float | None = None
    requests: int | None = None
    warmup_s: float = 0.0
    timeout_s: float = 60.0
    abort_error_rate: float | None = None
    abort_min_requests: int = 20
    slo: Slo = field(default_factory=Slo)
    progress_interval_s: float = 0.5
    # The last stretch before each planned send spent yielding to the event loop
    # instead of sleeping on a timer: timers wake up to ~1 ms late (epoll rounds up,
    # an idle process waits for its CPU), spinning costs CPU for that stretch per gap.
    spin_s: float = DEFAULT_SPIN_S
    client: Client = "auto"
    # This process's share of the run (None: all of it), and the wall-clock time (epoch
    # seconds) at which every share starts, so that shards on several machines begin
    # together; None: at once.
    shard: Shard | None = None
    start_at: float | None = None

    def __post_init__(self) -> None:
        if not self.targets:
            msg = "targets: give at least one URL (--url) or inventory worker (--workers)"
            raise InvalidInput(msg)
        for url in self.targets:
            if not re.match(r"^https?://[^/\s]+", url):
                msg = f"url: {url!r} is not an http(s) URL"
                raise InvalidInput(msg)
        if self.duration_s is None and self.requests is None and self.workload.trace is None:
            msg = "bound: give a duration or a number of requests (every run is bounded)"
            raise InvalidInput(msg)
        if self.duration_s is not None and self.duration_s <= 0:
            msg = "duration: must be positive"
            raise InvalidInput(msg)
        if self.requests is not None and self.requests < 1:
            msg = "requests: must be at least 1"
            raise InvalidInput(msg)
        if self.schedule.ramp_to is not None and self.duration_s is None:
            msg = "ramp: needs a duration to ramp over"
            raise InvalidInput(msg)
        if self.timeout_s <= 0:
            msg = "timeout: must be positive"
            raise InvalidInput(msg)
        if self.warmup_s < 0 or (self.duration_s is not None and self.warmup_s >= self.duration_s):
            msg = "warmup: must be non-negative and shorter than the duration"
            raise InvalidInput(msg)
        if not 0 <= self.spin_s <= 1:
            msg = "spin: must be between 0 and 1 s"
            raise InvalidInput(msg)
        if self.client == "aiohttp":
            msg = ("client: the aiohttp client was removed; http1 (the default) serves "
                   "http:// and https:// targets")
            raise InvalidInput(msg)
        if self.client not in ("auto", "http1"):
            msg = f"client: {self.client!r} is not auto or http1"
            raise InvalidInput(msg)
        if self.abort_error_rate is not None and not 0 < self.abort_error_rate <= 1:
            msg = "abort_error_rate: must be in (0, 1]"
            raise InvalidInput(msg)
        users = self.schedule.users
        if self.shard is not None and users is not None and users < self.shard.count:
            msg = f"shard: {users} users cannot be shared by {self.shard.count} shards"
            raise InvalidInput(msg)
