"""Exact percentiles over every sample, and the summary of a run.

Percentiles use the nearest-rank method over all samples (no histogram, no
interpolation): p99 is a latency some request really had.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dynamo_ftctl.loadgen.config import Slo
from dynamo_ftctl.loadgen.record import RequestRecord

__all__ = ["PERCENTILES", "Distribution", "LoadSummary", "percentile", "summarize"]

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


def percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of ascending `ordered` (NaN when empty)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class Distribution:
    """Percentiles of one latency, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    p99_9: float
    max: float

    @classmethod
    def of_seconds(cls, values: Iterable[float]) -> Distribution:
        """The distribution of `values` (seconds), reported in ms."""
        ordered = sorted(v * 1000.0 for v in values)
        if not ordered:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan, nan)
        p50, p90, p95, p99, p999 = (percentile(ordered, p) for p in PERCENTILES)
        return cls(len(ordered), sum(ordered) / len(ordered), p50, p90, p95, p99, p999,
                   ordered[-1])


@dataclass(frozen=True)
class LoadSummary:
    """The numbers of a run (measured requests only: warm-up excluded).

    Latencies are in ms and measured from each request's *planned* send time;
    the `_from_sent_ms` twins start at the actual send. `queue_ms` is the gap
    between them. Rates divide by the measured window (end of warm-up to the
    last answer).
    """

    window_s: float
    planned_requests: int
    completed: int
    failed: int
    migrated: int
    requests_per_s: float
    output_tokens_per_s: float
    goodput_requests_per_s: float | None
    error_rate: float
    errors_by_class: dict[str, int]
    queue_ms: Distribution
    ttft_ms: Distribution
    ttft_from_sent_ms: Distribution
    itl_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution
    e2e_from_sent_ms: Distribution
    output_tokens: int
    slo_met: bool | None
    # Shed answers (429, 503, 529) that said when to come back (`Retry-After`).
    shed_with_retry_after: int = 0


def meets_slo(slo: Slo, summary: LoadSummary) -> bool | None:
    """Whether a summary meets the SLO (None when no objective is set)."""
    if slo.empty:
        return None
    checks: list[bool] = []
    if slo.ttft_p99_ms is not None:
        checks.append(summary.ttft_ms.count > 0 and summary.ttft_ms.p99 <= slo.ttft_p99_ms)
    if slo.itl_p99_ms is not None:
        # No inter-token gaps (non-streamed, one-token answers) cannot break an ITL SLO.
        checks.append(summary.itl_ms.count == 0 or summary.itl_ms.p99 <= slo.itl_p99_ms)
    if slo.error_rate is not None:
        checks.append(summary.error_rate <= slo.error_rate)
    return all(checks)


def _good(record: RequestRecord, slo: Slo) -> bool:
    if not record.ok:
        return False
    ttft = record.ttft_s
    if slo.ttft_p99_ms is not None and (ttft is None or ttft * 1000 > slo.ttft_p99_ms):
        return False
    tpot = record.tpot_s
    return not (slo.itl_p99_ms is not None and tpot is not None
                and tpot * 1000 > slo.itl_p99_ms)


def summarize(records: Sequence[RequestRecord], *, slo: Slo, measure_from: float,
              planned_requests: int) -> LoadSummary:
    """Summarize the records that are not warm-up."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    end = max((r.done for r in measured), default=measure_from)
    window = max(end - measure_from, 1e-9)
    errors: dict[str, int] = {}
    for r in measured:
        if not r.ok:
            errors[r.outcome] = errors.get(r.outcome, 0) + 1
    tokens = sum(r.output_tokens for r in ok)
    goodput = None if slo.empty else sum(1 for r in ok if _good(r, slo)) / window
    summary = LoadSummary(
        window_s=window,
        planned_requests=planned_requests,
        completed=len(ok),
        failed=len(measured) - len(ok),
        migrated=sum(1 for r in ok if r.outcome == "migrated"),
        requests_per_s=len(ok) / window,
        output_tokens_per_s=tokens / window,
        goodput_requests_per_s=goodput,
        error_rate=(len(measured) - len(ok)) / len(measured) if measured else 0.0,
        errors_by_class=dict(sorted(errors.items())),
        queue_ms=Distribution.of_seconds(r.queue_s for r in measured),
        ttft_ms=Distribution.of_seconds(r.ttft_s for r in ok if r.ttft_s is not None),
        ttft_from_sent_ms=Distribution.of_seconds(
            r.ttft_from_sent_s for r in ok if r.ttft_from_sent_s is not None),
        itl_ms=Distribution.of_seconds(gap for r in ok for gap in r.itl),
        tpot_ms=Distribution.of_seconds(r.tpot_s for r in ok if r.tpot_s is not None),
        e2e_ms=Distribution.of_seconds(r.e2e_s for r in ok),
        e2e_from_sent_ms=Distribution.of_seconds(r.e2e_from_sent_s for r in ok),
        output_tokens=tokens,
        slo_met=None,
        shed_with_retry_after=sum(1 for r in measured if r.retry_after_s is not None),
    )
    met = meets_slo(slo, summary)
    if met is None:
        return summary
    from dataclasses import replace

    return replace(summary, slo_met=met)
