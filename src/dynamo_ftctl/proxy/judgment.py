"""Whose fault a failed upstream attempt is: the one place that judges.

Every way an attempt can end without a whole answer is an `Outcome` (what the
worker did, as `proxy/attempt.py` saw it); `judge` turns it into a `Verdict`:
one of four blames with the evidence that decided it. The migration policy
(`proxy/policy.py`) acts on verdicts and never looks at statuses itself; the
fleet (`proxy/fleet.py`) opens a breaker only on a worker that also fails a
known-good probe. The rules, in order (docs/design.md "Failure attribution"):

    outcome                                          blame          way
    no connection made (refused, unreachable)        worker
    429, 503, 529 (answer or error event)            backpressure
    404/400 naming the model, or an empty 404        absent
    any other 4xx but 408 (answer or error event)    request
    not an OpenAI answer (HTML, bad JSON, lies)      worker
    cut after the attempt's first token (otherwise)  unknown
    408, 502, 504 (a timeout or a gateway's word)    unknown
    no token within the stall timeout                unknown
    other 5xx, an error event without a 4xx code     unknown        "HTTP 500", "error event"
    connection lost after the request went out       unknown        "connection lost"

A `way` is the failure's shape: the same way on two workers is a query of death.
`unknown` is never charged by itself: another worker's outcome resolves it (served
there: the first worker is charged; failed the same way: a query of death, nobody
is), and where no second opinion is possible the fleet asks the worker a
known-good request before any breaker moves. A charge against a worker that
answers that probe is logged and counted, never acted on.

`QueryMemory` remembers requests that end many streams at once (a batch death:
one poisoned request failing an engine step ends every stream batched with it),
by a fingerprint of their parameters: a suspected copy runs on one worker at a
time, and one that kills a second batch is refused with 422 `query_of_death`
until the memory expires (Google's SRE book, "Addressing Cascading Failures").

Pure code: no I/O, time from a `Clock`.
"""

from __future__ import annotations

import enum
import json
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dynamo_ftctl.clock import Clock  # a dataclass field's type: read at run time (mypyc)

try:  # hashlib.blake2b without hashlib's import of OpenSSL (as yamlcache does)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - CPython always builds _blake2
    from hashlib import blake2b

if TYPE_CHECKING:
    from collections.abc import Mapping


__all__ = ["BACKPRESSURE_STATUSES", "Blame", "Outcome", "QueryMemory", "Verdict",
           "fingerprint", "judge", "retry_after_s"]

# Statuses that say "not now": vLLM and Dynamo answer 503 (and 529) when overloaded,
# OpenAI-style servers 429; each may carry Retry-After.
BACKPRESSURE_STATUSES = frozenset({429, 503, 529})
# A timeout or a gateway's answer: the worker (or what stands behind it) did not
# answer, which says nothing about the request.
_GATEWAY_STATUSES = frozenset({408, 502, 504})
# Retry-After beyond this is taken as this (a worker may not park itself for hours).
MAX_RETRY_AFTER_S = 300.0
# Phrases with which servers say a model is not theirs (vLLM: "The model `m` does not
# exist."; Dynamo: "Model not found: m"; SGLang, TGI and llama.cpp similar).
_ABSENT_PHRASES = ("does not exist", "not found", "no such model", "unknown model",
                   "not served", "not available", "not loaded", "no model", "model not")

OutcomeKind = Literal["unreachable", "status", "event", "lost", "stalled", "garbage"]


class Blame(enum.Enum):
    """Who a failed attempt is charged to."""

    REQUEST = "request"  # the client's input: passed on, no worker charged
    WORKER = "worker"  # evidence about the worker itself
    BACKPRESSURE = "backpressure"  # the worker is full: weighted down, nothing charged
    ABSENT = "absent"  # the worker does not serve this model (now): out for the model
    UNKNOWN = "unknown"  # either's: a second opinion or a known-good probe decides


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended without a whole answer, as the attempt saw it.

    `kind`: no connection (`unreachable`), an HTTP answer other than 200 (`status`),
    an SSE error event (`event`, `status` its code if any), the connection lost
    after the request went out (`lost`), no token in time (`stalled`), or an
    answer that is not an OpenAI one (`garbage`).
    """

    kind: OutcomeKind
    message: str
    status: int | None = None
    body: bytes = b""
    content_type: str = "application/json"
    retry_after: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """`judge`'s answer: the blame, why, and what the policy needs to act on it."""

    blame: Blame
    evidence: str
    way: str | None = None  # the same way on two workers is a query of death
    retry_after_s: float | None = None  # backpressure: how long to spare the worker


def judge(outcome: Outcome, model: str | None, tokens: int) -> Verdict:
    """The verdict on `outcome` of a request for `model` after `tokens` tokens of this attempt
    (the table in the module's docstring)."""
    kind, status = outcome.kind, outcome.status
    if kind == "unreachable":
        return Verdict(Blame.WORKER, f"unreachable: {outcome.message}")
    if status in BACKPRESSURE_STATUSES:
        return Verdict(Blame.BACKPRESSURE, f"HTTP {status}: busy",
                       retry_after_s=retry_after_s(outcome.retry_after))
    if kind == "status" and status is not None and _names_absent_model(status, outcome.body,
                                                                       model):
        return Verdict(Blame.ABSENT, f"HTTP {status}: does not serve {model}")
    if status is not None and 400 <= status < 500 and status != 408:
        return Verdict(Blame.REQUEST, f"HTTP {status}: refused the request")
    if kind == "garbage":
        return Verdict(Blame.WORKER, f"not an OpenAI answer: {outcome.message}")
    if tokens:
        return Verdict(Blame.UNKNOWN, f"cut after {tokens} tokens: {outcome.message}")
    if status in _GATEWAY_STATUSES or kind == "stalled":
        return Verdict(Blame.UNKNOWN, outcome.message)
    if kind == "status":
        return Verdict(Blame.UNKNOWN, outcome.message, way=f"HTTP {status}")
    if kind == "event":
        return Verdict(Blame.UNKNOWN, outcome.message,
                       way=f"error event {status or ''}".rstrip())
    return Verdict(Blame.UNKNOWN, outcome.message, way="connection lost")


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header in seconds (delta-seconds only), capped; None when absent or bad."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not seconds >= 0:  # NaN too
        return None
    return min(seconds, MAX_RETRY_AFTER_S)


def _names_absent_model(status: int, body: bytes, model: str | None) -> bool:
    """A 404 with an empty body (a frontend that lost its workers' routes), or a 404/400
    whose message names `model` as absent."""
    if status not in (400, 404):
        return False
    text = body[:4096].decode("utf-8", "replace").strip()
    if status == 404 and not text:
        return True
    if not model or model not in text:
        return False
    lowered = text.lower()
    return any(phrase in lowered for phrase in _ABSENT_PHRASES)


# ---------------------------------------------------------------------- query-of-death memory

# Fields that do not change what an engine computes: two requests that differ only in
# these are the same query.
_VOLATILE_FIELDS = frozenset({"stream", "stream_options", "user", "return_token_ids"})


def fingerprint(body: Mapping[str, Any]) -> str:
    """A stable digest of what a request asks an engine to compute (its parameters)."""
    kept = {k: v for k, v in body.items() if k not in _VOLATILE_FIELDS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(slots=True)
class _Failure:
    at: float
    request: int  # the failing request's serial (one request may fail twice)
    print_: str
    tokens: int
    held: bool  # the request started while its fingerprint was suspected


@dataclass(slots=True)
class QueryMemory:
    """Requests that ended many streams at once, by fingerprint, for `ttl_s`.

    `note_failure` is told of every `unknown` failure on a worker. When at least two
    requests fail on one worker within `window_s` and one of them had streamed tokens
    (a batch died, not just two copies of one bad request), every request among them
    that failed before its first token is a candidate: it joined the batch and the
    step it joined failed. A candidate's fingerprint becomes suspected. A candidate
    that was already suspected when it started (`held`: the policy runs such copies
    one at a time) is convicted: it killed a batch again, and this time it was the
    only suspect in flight. Both expire `ttl_s` after they were last seen. Bounded:
    at most `max_entries` fingerprints, the oldest go first.
    """

    clock: Clock
    window_s: float = 1.0
    ttl_s: float = 600.0
    max_entries: int = 4096
    _recent: dict[str, deque[_Failure]] = field(default_factory=dict)
    _suspected: dict[str, float] = field(default_factory=dict)  # fingerprint -> last seen
    _convicted: dict[str, float] = field(default_factory=dict)
    _blamed: set[tuple[str, int]] = field(default_factory=set)  # (worker, death) counted

    def note_failure(self, worker: str, request: int, print_: str, tokens: int, *,
                     held: bool = False) -> list[str]:
        """Record one failure on `worker`; the fingerprints this convicts (usually none)."""
        now = self.clock.now()
        recent = self._recent.setdefault(worker, deque(maxlen=256))
        while recent and now - recent[0].at > self.window_s:
            recent.popleft()
        recent.append(_Failure(now, request, print_, tokens, held))
        if len({f.request for f in recent}) < 2 or not any(f.tokens for f in recent):
            return []
        convicted = []
        for failure in recent:
            if failure.tokens:
                continue
            # One batch death counts once per candidate, however many victims report it.
            death = (worker, failure.request)
            if death in self._blamed:
                continue
            self._blamed.add(death)
            if len(self._blamed) > self.max_entries:
                self._blamed.clear()
            if failure.held:
                self._remember(self._convicted, failure.print_, now)
                convicted.append(failure.print_)
            self._remember(self._suspected, failure.print_, now)
        return convicted

    def forgive(self, print_: str) -> None:
        """Forget a fingerprint: the batch death it was a candidate in was a worker that
        died (it fails the known-good probe), which no request is blamed for."""
        self._suspected.pop(print_, None)
        self._convicted.pop(print_, None)

    def remembers(self) -> bool:
        """Whether any fingerprint is suspected or convicted (else no request need be
        fingerprinted to be looked up)."""
        return bool(self._suspected or self._convicted)

    def suspected(self, print_: str) -> bool:
        """Whether requests with this fingerprint killed a batch within `ttl_s`."""
        return self._fresh(self._suspected, print_)

    def convicted(self, print_: str) -> bool:
        """Whether requests with this fingerprint killed two batches within `ttl_s`."""
        return self._fresh(self._convicted, print_)

    def _fresh(self, table: dict[str, float], print_: str) -> bool:
        seen = table.get(print_)
        if seen is None:
            return False
        if self.clock.now() - seen > self.ttl_s:
            del table[print_]
            return False
        return True

    def _remember(self, table: dict[str, float], print_: str, now: float) -> None:
        table.pop(print_, None)
        table[print_] = now
        while len(table) > self.max_entries:
            del table[next(iter(table))]
