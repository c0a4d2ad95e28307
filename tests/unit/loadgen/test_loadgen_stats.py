"""Exact percentiles and the run summary: warm-up excluded, errors by class, SLO and goodput."""

from __future__ import annotations

import math

import pytest

from dynamo_ftctl.loadgen.config import Slo
from dynamo_ftctl.loadgen.record import RequestRecord
from dynamo_ftctl.loadgen.stats import Distribution, percentile, summarize


def _rec(index: int, *, planned: float, sent: float | None = None, ttft: float = 0.01,
         done_after: float = 0.05, outcome: str = "ok", warmup: bool = False,
         tokens: int = 5, itl: tuple[float, ...] = ()) -> RequestRecord:
    sent = planned if sent is None else sent
    return RequestRecord(index=index, target="t", planned=planned, sent=sent,
                         done=sent + done_after,
                         first_token=sent + ttft if outcome in ("ok", "migrated") else None,
                         output_tokens=tokens if outcome in ("ok", "migrated") else 0,
                         itl=itl, status=200, outcome=outcome, warmup=warmup)


def test_percentile_is_nearest_rank_over_all_samples():
    """p50 of 1..100 is 50, p99 is 99, p99.9 is 100: values some sample really had."""
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 99.9) == 100
    assert percentile([7.0], 99) == 7
    assert math.isnan(percentile([], 50))


def test_distribution_reports_milliseconds():
    """A distribution of seconds reports ms, with max and mean."""
    d = Distribution.of_seconds([0.001, 0.002, 0.003, 0.010])
    assert d.count == 4
    assert d.max == pytest.approx(10.0)
    assert d.p50 == pytest.approx(2.0)
    assert d.mean == pytest.approx(4.0)


def test_summary_excludes_warmup_and_counts_error_classes():
    """Warm-up requests vanish from counts; failures are grouped by class."""
    records = [
        _rec(0, planned=0.0, warmup=True, done_after=5.0),
        _rec(1, planned=1.0),
        _rec(2, planned=1.1, outcome="5xx_503"),
        _rec(3, planned=1.2, outcome="5xx_503"),
        _rec(4, planned=1.3, outcome="connect"),
        _rec(5, planned=1.4, outcome="migrated"),
    ]
    s = summarize(records, slo=Slo(), measure_from=1.0, planned_requests=5)
    assert s.completed == 2
    assert s.failed == 3
    assert s.migrated == 1
    assert s.errors_by_class == {"5xx_503": 2, "connect": 1}
    assert s.error_rate == pytest.approx(0.6)
    assert s.e2e_ms.max == pytest.approx(50.0)
    assert s.slo_met is None
    assert s.goodput_requests_per_s is None


def test_latency_from_planned_includes_the_queue():
    """A request sent 2 s late reports 2 s more latency from planned than from sent."""
    s = summarize([_rec(0, planned=0.0, sent=2.0)], slo=Slo(), measure_from=0.0,
                  planned_requests=1)
    assert s.queue_ms.p50 == pytest.approx(2000.0)
    assert s.e2e_ms.p50 == pytest.approx(2050.0)
    assert s.e2e_from_sent_ms.p50 == pytest.approx(50.0)
    assert s.ttft_ms.p50 == pytest.approx(2010.0)


def test_slo_and_goodput():
    """The SLO is judged on p99 TTFT and error rate; goodput counts requests within it."""
    fast = [_rec(i, planned=i * 0.1, ttft=0.01) for i in range(9)]
    slow = [_rec(9, planned=0.9, ttft=0.5)]
    s = summarize(fast + slow, slo=Slo(ttft_p99_ms=100), measure_from=0.0,
                  planned_requests=10)
    assert s.slo_met is False
    assert s.goodput_requests_per_s == pytest.approx(9 / s.window_s)
    s2 = summarize(fast, slo=Slo(ttft_p99_ms=100, error_rate=0.0), measure_from=0.0,
                   planned_requests=9)
    assert s2.slo_met is True


def test_itl_samples_pool_every_gap():
    """Inter-token latencies are pooled over requests; TPOT is per streamed request."""
    records = [_rec(0, planned=0, itl=(0.001, 0.003), tokens=3, ttft=0.01, done_after=0.014),
               _rec(1, planned=0, itl=(0.002,), tokens=2, ttft=0.01, done_after=0.012)]
    s = summarize(records, slo=Slo(), measure_from=0.0, planned_requests=2)
    assert s.itl_ms.count == 3
    assert s.itl_ms.max == pytest.approx(3.0)
    assert s.tpot_ms.count == 2
    assert s.tpot_ms.max == pytest.approx(2.0)
