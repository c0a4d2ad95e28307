"""Bearer tokens for every endpoint that changes state, and a per-source rate limit.

The endpoints that change a service's state over HTTP check one shared secret,
read from an environment variable (never a flag, so it stays out of `ps`):

    service               endpoints                                variable (default)
    canary daemon         POST /report                             FTCTL_DAEMON_TOKEN
    ftctl sim             POST /sleep, /wake_up, /admin/*          FTCTL_ADMIN_TOKEN
    fault proxy control   POST /toxics, DELETE /toxics[/NAME]      FTCTL_NETPROXY_TOKEN
    migrating proxy       POST /busy_threshold                     FTCTL_ADMIN_TOKEN

and all of them the same way (`check_bearer`):

- only the `Authorization` header counts, as `Bearer <token>` with the scheme in
  any case (RFC 7235 section 2.1: auth schemes are case-insensitive); a token in
  the query string or in any other header is no token (query strings end up in
  access logs and proxies' histories);
- the comparison is `secrets.compare_digest` on the UTF-8 bytes (constant time:
  a wrong guess takes as long whatever prefix it shares);
- no token configured on the service: 403, the endpoint is refused (a service
  never runs a mutating endpoint open because a variable was forgotten);
  missing or wrong token: 401 with `WWW-Authenticate: Bearer`.

Each service renders the `Denial` in its own error format: this module imports
no web framework. `RateLimiter` is a token bucket per source (client address),
driven by a `Clock` so tests move time instead of sleeping.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "ADMIN_TOKEN_ENV",
    "DAEMON_TOKEN_ENV",
    "NETPROXY_TOKEN_ENV",
    "Denial",
    "RateLimiter",
    "bearer_headers",
    "bearer_token",
    "check_bearer",
    "token_from_env",
]

ADMIN_TOKEN_ENV = "FTCTL_ADMIN_TOKEN"  # noqa: S105 - a variable's name, not a secret
DAEMON_TOKEN_ENV = "FTCTL_DAEMON_TOKEN"  # noqa: S105 - a variable's name, not a secret
NETPROXY_TOKEN_ENV = "FTCTL_NETPROXY_TOKEN"  # noqa: S105 - a variable's name, not a secret


@dataclass(frozen=True)
class Denial:
    """Why a request was refused: 401 (no or wrong token) or 403 (none configured)."""

    status: int
    message: str

    @property
    def headers(self) -> dict[str, str]:
        """`WWW-Authenticate: Bearer` on a 401 (RFC 6750 section 3), nothing on a 403."""
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}


def token_from_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The token in `$name`; None when the variable is unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "")
    return value or None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (any case); None otherwise."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def check_bearer(authorization: str | None, expected: str | None, *,
                 unset: str) -> Denial | None:
    """None when `authorization` carries `expected`; else the `Denial` to answer.

    `unset` names what is missing when the service has no token (the 403's
    message), e.g. "reports disabled: $FTCTL_DAEMON_TOKEN is not set".
    """
    if not expected:
        return Denial(403, unset)
    given = bearer_token(authorization)
    if given is None or not secrets.compare_digest(given.encode(), expected.encode()):
        return Denial(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    return None


def bearer_headers(token: str | None) -> dict[str, str]:
    """`{"Authorization": "Bearer <token>"}`, or no header without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class RateLimiter:
    """A token bucket per source: `burst` at once, then `rate_per_s` a second.

    At most `max_sources` buckets are kept: the longest unused goes first (a
    forgotten source starts again with a full bucket, which is what it would
    have refilled to anyway unless it was seen in the last `burst / rate_per_s`).
    """

    rate_per_s: float
    burst: int
    clock: Clock = SYSTEM_CLOCK
    max_sources: int = 4096
    _buckets: dict[str, _Bucket] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1 or self.max_sources < 1:
            msg = "a rate limit needs rate_per_s > 0, burst >= 1 and max_sources >= 1"
            raise ValueError(msg)

    def take(self, source: str) -> float:
        """Take one token of `source`'s bucket: 0.0 when taken, else seconds until one is there."""
        now = self.clock.now()
        bucket = self._buckets.pop(source, None)  # re-inserted last: dict order is LRU order
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
            while len(self._buckets) >= self.max_sources:
                del self._buckets[next(iter(self._buckets))]
        else:
            bucket.tokens = min(float(self.burst),
                                bucket.tokens + (now - bucket.at) * self.rate_per_s)
            bucket.at = now
        self._buckets[source] = bucket
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """A `Retry-After` header value (whole seconds, at least 1) for `take`'s wait."""
        return str(max(1, math.ceil(wait_s)))
