"""Bearer-token checks and the per-source rate limiter shared by every mutating endpoint."""

from __future__ import annotations

import pytest

from dynamo_ftctl.auth import (
    RateLimiter,
    bearer_headers,
    bearer_token,
    check_bearer,
    token_from_env,
)
from dynamo_ftctl.clock import FakeClock

UNSET = "disabled: $T is not set"


@pytest.mark.parametrize("header", ["Bearer s3cret", "bearer s3cret", "BEARER s3cret",
                                    "Bearer   s3cret ", " Bearer s3cret"])
def test_the_bearer_scheme_is_case_insensitive(header: str) -> None:
    """`Bearer` in any case, with extra blanks around the token, is accepted."""
    assert check_bearer(header, "s3cret", unset=UNSET) is None


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "s3cret", "Token s3cret",
                                    "Basic czNjcmV0", "Bearer s3cre", "Bearer s3cret2",
                                    "Bearers3cret", "Bearer S3CRET"])
def test_missing_wrong_or_misplaced_tokens_get_401(header: str | None) -> None:
    """No header, another scheme, a bare token or a near miss is a 401 asking for Bearer."""
    denied = check_bearer(header, "s3cret", unset=UNSET)
    assert denied is not None
    assert denied.status == 401
    assert denied.headers == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("expected", [None, ""])
def test_no_token_configured_refuses_everyone_with_403(expected: str | None) -> None:
    """A service without a token refuses even a request that sends one (never open)."""
    denied = check_bearer("Bearer anything", expected, unset=UNSET)
    assert denied is not None
    assert (denied.status, denied.message, denied.headers) == (403, UNSET, {})


def test_non_ascii_tokens_compare_as_bytes() -> None:
    """A non-ASCII token matches itself and nothing else (compare_digest on str would raise)."""
    assert check_bearer("Bearer clé", "clé", unset=UNSET) is None
    denied = check_bearer("Bearer cle", "clé", unset=UNSET)
    assert denied is not None
    assert denied.status == 401


def test_tokens_come_from_the_environment_and_empty_is_unset() -> None:
    """An empty variable is no token; headers carry a token only when there is one."""
    assert token_from_env("T", {"T": "x"}) == "x"
    assert token_from_env("T", {"T": ""}) is None
    assert token_from_env("T", {}) is None
    assert bearer_headers("x") == {"Authorization": "Bearer x"}
    assert bearer_headers(None) == {}
    assert bearer_token("bEaReR abc") == "abc"


def test_a_bucket_takes_a_burst_then_the_rate() -> None:
    """`burst` at once, then one more per 1/rate seconds; the wait says how long."""
    clock = FakeClock()
    limiter = RateLimiter(rate_per_s=2.0, burst=3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)
    assert RateLimiter.retry_after(0.5) == "1"
    assert RateLimiter.retry_after(2.1) == "3"
    clock.advance(0.5)
    assert limiter.take("a") == 0.0
    assert limiter.take("a") > 0.0
    clock.advance(100.0)  # refills to the burst, not beyond
    assert [limiter.take("a") for _ in range(4)][-1] > 0.0


def test_sources_have_buckets_of_their_own_and_old_ones_are_dropped() -> None:
    """One source's flood does not limit another; at most max_sources buckets are kept."""
    clock = FakeClock()
    limiter = RateLimiter(rate_per_s=1.0, burst=1, clock=clock, max_sources=2)
    assert limiter.take("a") == 0.0
    assert limiter.take("a") > 0.0
    assert limiter.take("b") == 0.0
    assert limiter.take("b") > 0.0
    assert limiter.take("c") == 0.0  # a third source: "a", the longest unused, is dropped
    assert limiter.take("c") > 0.0
    assert limiter.take("a") == 0.0  # forgotten: a full bucket again ("b" goes now)
    assert limiter.take("c") > 0.0  # still remembered


def test_a_limiter_without_room_is_refused() -> None:
    """A zero rate or burst is a programming error, not a silent block of everything."""
    with pytest.raises(ValueError, match="rate_per_s"):
        RateLimiter(rate_per_s=0.0, burst=1)
    with pytest.raises(ValueError, match="burst"):
        RateLimiter(rate_per_s=1.0, burst=0)
