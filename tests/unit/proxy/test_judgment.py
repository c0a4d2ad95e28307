"""The one judgment of whose fault a failed attempt is (`proxy/judgment.py`), rule by rule,
and over generated outcomes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.proxy.judgment import (
    BACKPRESSURE_STATUSES,
    MAX_RETRY_AFTER_S,
    Blame,
    Outcome,
    QueryMemory,
    fingerprint,
    judge,
    retry_after_s,
)

MODEL = "m-1"
KINDS = ("unreachable", "status", "event", "lost", "stalled", "garbage")


def status(code: int, body: bytes = b"", retry_after: str | None = None) -> Outcome:
    return Outcome("status", f"HTTP {code}", status=code, body=body, retry_after=retry_after)


@pytest.mark.parametrize(("outcome", "tokens", "blame", "way"), [
    (Outcome("unreachable", "refused"), 0, Blame.WORKER, None),
    (status(429, retry_after="30"), 0, Blame.BACKPRESSURE, None),
    (status(503), 0, Blame.BACKPRESSURE, None),
    (status(529), 0, Blame.BACKPRESSURE, None),
    (Outcome("event", "overloaded", status=429), 4, Blame.BACKPRESSURE, None),
    (status(404), 0, Blame.ABSENT, None),
    (status(404, b'{"error":{"message":"The model `m-1` does not exist."}}'), 0,
     Blame.ABSENT, None),
    (status(400, b'{"error":{"message":"Model not found: m-1"}}'), 0, Blame.ABSENT, None),
    (status(404, b'{"error":{"message":"no route"}}'), 0, Blame.REQUEST, None),
    (status(400, b'{"error":{"message":"m-1: top_k must be positive"}}'), 0,
     Blame.REQUEST, None),
    (status(409), 0, Blame.REQUEST, None),
    (Outcome("event", "bad", status=400), 3, Blame.REQUEST, None),
    (Outcome("garbage", "<html>"), 0, Blame.WORKER, None),
    (Outcome("garbage", "bad json"), 7, Blame.WORKER, None),
    (Outcome("lost", "reset"), 7, Blame.UNKNOWN, None),
    (Outcome("event", "engine died", status=500), 7, Blame.UNKNOWN, None),
    (status(502), 0, Blame.UNKNOWN, None),
    (status(504), 0, Blame.UNKNOWN, None),
    (status(408), 0, Blame.UNKNOWN, None),
    (Outcome("stalled", "no token"), 0, Blame.UNKNOWN, None),
    (status(500), 0, Blame.UNKNOWN, "HTTP 500"),
    (Outcome("event", "engine died", status=500), 0, Blame.UNKNOWN, "error event 500"),
    (Outcome("event", "engine died"), 0, Blame.UNKNOWN, "error event"),
    (Outcome("lost", "reset"), 0, Blame.UNKNOWN, "connection lost"),
])
def test_each_rule_of_the_table(outcome: Outcome, tokens: int, blame: Blame,
                                way: str | None) -> None:
    """Each row of the module's table gives its blame and, for unknowns, its way."""
    verdict = judge(outcome, MODEL, tokens)
    assert (verdict.blame, verdict.way) == (blame, way)
    assert verdict.evidence


@given(kind=st.sampled_from(KINDS), code=st.none() | st.integers(100, 599),
       body=st.binary(max_size=200), tokens=st.integers(0, 10_000),
       retry=st.none() | st.text(max_size=12))
def test_backpressure_and_client_errors_never_blame_the_worker(
        kind: str, code: int | None, body: bytes, tokens: int, retry: str | None) -> None:
    """Whatever the outcome: 429/503/529 are backpressure, another 4xx (but 408) is never
    the worker's, a way is given only before the attempt's first token, and only a worker
    that could not be reached or answered garbage is blamed outright."""
    outcome = Outcome(kind, "x", status=None if kind in ("unreachable", "lost", "stalled",
                                                         "garbage") else code,
                      body=body, retry_after=retry)
    verdict = judge(outcome, MODEL, tokens)
    if kind == "unreachable":
        assert verdict.blame is Blame.WORKER
        return
    if outcome.status in BACKPRESSURE_STATUSES:
        assert verdict.blame is Blame.BACKPRESSURE
        seconds = verdict.retry_after_s
        assert seconds is None or 0 <= seconds <= MAX_RETRY_AFTER_S
    if outcome.status is not None and 400 <= outcome.status < 500 and outcome.status != 408:
        assert verdict.blame is not Blame.WORKER
    if verdict.blame is Blame.WORKER:
        assert kind == "garbage"
    if tokens:
        assert verdict.way is None


@pytest.mark.parametrize(("header", "seconds"), [
    ("30", 30.0), (" 2.5 ", 2.5), ("0", 0.0), ("100000", MAX_RETRY_AFTER_S), ("-1", None),
    ("nan", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None), (None, None), ("", None),
])
def test_retry_after_is_read_as_bounded_seconds(header: str | None,
                                                seconds: float | None) -> None:
    """Retry-After in seconds, capped; dates, negatives and junk count as absent."""
    assert retry_after_s(header) == seconds


def test_a_fingerprint_ignores_how_the_answer_is_delivered() -> None:
    """Streamed or not, with ids or not: the same query; other parameters change it."""
    body = {"model": MODEL, "prompt": "p", "top_k": 2**63, "temperature": 1}
    assert fingerprint(body) == fingerprint({**body, "stream": True, "return_token_ids": True,
                                             "stream_options": {"include_usage": True}})
    assert fingerprint(body) != fingerprint({**body, "top_k": 2**62})
    assert fingerprint(body) != fingerprint({**body, "prompt": "q"})


def memory() -> tuple[QueryMemory, FakeClock]:
    clock = FakeClock()
    return QueryMemory(clock, window_s=1.0, ttl_s=600.0), clock


def test_a_batch_death_suspects_the_request_that_failed_before_its_first_token() -> None:
    """Victims cut mid-stream and one request failing before any token, on one worker at
    once: that request is suspected (not convicted); the victims are not."""
    mem, _ = memory()
    assert not mem.remembers()  # the proxy fingerprints no request until it does
    assert mem.note_failure("w0", 1, "poison", 0) == []
    assert mem.note_failure("w0", 2, "victim-a", 12) == []
    assert mem.note_failure("w0", 3, "victim-b", 30) == []
    assert mem.suspected("poison")
    assert mem.remembers()
    assert not mem.suspected("victim-a")
    assert not mem.suspected("victim-b")
    assert not mem.convicted("poison")


def test_the_order_in_which_failures_arrive_does_not_matter() -> None:
    """The victims' failures may be seen before the culprit's."""
    mem, _ = memory()
    mem.note_failure("w0", 2, "victim", 12)
    mem.note_failure("w0", 1, "poison", 0)
    assert mem.suspected("poison")


def test_no_batch_death_without_a_stream_cut_mid_way() -> None:
    """Two requests failing before their first token (two copies of one bad request, or a
    worker that refuses connections) are no batch death: nothing is suspected."""
    mem, _ = memory()
    mem.note_failure("w0", 1, "a", 0)
    mem.note_failure("w0", 2, "b", 0)
    assert not mem.suspected("a")
    assert not mem.suspected("b")


def test_failures_further_apart_than_the_window_are_separate() -> None:
    """A cut stream and a failure 2 s later on the same worker are not one batch death;
    nor are failures on two workers."""
    mem, clock = memory()
    mem.note_failure("w0", 1, "victim", 5)
    clock.advance(2.0)
    mem.note_failure("w0", 2, "late", 0)
    mem.note_failure("w1", 3, "other", 0)
    assert not mem.suspected("late")
    assert not mem.suspected("other")


def test_a_held_copy_that_kills_again_is_convicted_until_the_memory_expires() -> None:
    """A copy that ran while suspected and killed a batch again is convicted; both marks
    are forgotten after ttl_s."""
    mem, clock = memory()
    mem.note_failure("w0", 1, "poison", 0)
    mem.note_failure("w0", 2, "victim", 9)
    clock.advance(5.0)
    mem.note_failure("w1", 3, "victim-2", 4)
    assert mem.note_failure("w1", 4, "poison", 0, held=True) == ["poison"]
    assert mem.convicted("poison")
    clock.advance(601.0)
    assert not mem.convicted("poison")
    assert not mem.suspected("poison")


def test_one_batch_death_is_counted_once_per_candidate() -> None:
    """Many victims reporting the same death do not count the culprit again and again."""
    mem, _ = memory()
    mem.note_failure("w0", 1, "poison", 0, held=True)
    convicted = [mem.note_failure("w0", 10 + i, f"victim-{i}", 3) for i in range(20)]
    assert sum(len(c) for c in convicted) == 1


def test_the_memory_is_bounded() -> None:
    """However many fingerprints are suspected, at most max_entries are kept."""
    clock = FakeClock()
    mem = QueryMemory(clock, max_entries=8)
    for i in range(100):
        mem.note_failure("w0", 2 * i, f"p{i}", 0)
        mem.note_failure("w0", 2 * i + 1, "victim", 3)
        clock.advance(2.0)
    assert sum(mem.suspected(f"p{i}") for i in range(100)) <= 8
    assert mem.suspected("p99")
