"""ftctl's exported series: `ftctl_*` names, Dynamo's names only for mirrors, all documented."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from prometheus_client import Histogram
from prometheus_client.metrics import MetricWrapperBase

from dynamo_ftctl import metrics

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
# Series exported under Dynamo's exact name and labels (docs/metrics.md, "The Dynamo mirror").
# Dynamo 1.6's lib/llm/src/http/service/metrics.rs: IntCounterVec, HistogramVec, IntGaugeVec.
DYNAMO_MIRRORS = {
    "dynamo_frontend_model_migration_total": ("counter", ("model", "migration_type")),
    "dynamo_frontend_model_migration_duration_seconds":
        ("histogram", ("model", "migration_type", "outcome")),
    "dynamo_frontend_model_migration_limit": ("gauge", ("model",)),
    "dynamo_frontend_requests_total":
        ("counter", ("model", "endpoint", "request_type", "status", "error_type")),
    "dynamo_frontend_inflight_requests": ("gauge", ("model",)),
    "dynamo_frontend_request_duration_seconds": ("histogram", ("model",)),
    "dynamo_frontend_time_to_first_token_seconds": ("histogram", ("model",)),
    "dynamo_frontend_inter_token_latency_seconds": ("histogram", ("model",)),
}
# The `prometheus` crate's DEFAULT_BUCKETS, which Dynamo's migration histogram uses.
DYNAMO_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _registered() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each series of metrics.py by its exposed name, with its type and label names."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        (family,) = collector.describe()
        name = f"{family.name}_total" if family.type == "counter" else family.name
        # prometheus_client shows label names only on samples, and an unused labelled
        # series has none: the wrapper's own record is the one place they are listed.
        found[name] = (family.type, tuple(collector._labelnames))
    return found


def test_registry_matches_metric_names() -> None:
    """METRIC_NAMES (what the alert test checks against) is exactly what the registry holds."""
    assert set(_registered()) == metrics.METRIC_NAMES


def test_own_series_are_ftctl_and_mirrors_keep_dynamos_labels() -> None:
    """Every series is `ftctl_*` but the Dynamo mirrors, which carry Dynamo's exact type and
    labels."""
    registered = _registered()
    assert set(DYNAMO_MIRRORS) <= set(registered)
    for name, kind_labels in registered.items():
        if name in DYNAMO_MIRRORS:
            assert kind_labels == DYNAMO_MIRRORS[name], name
        else:
            assert name.startswith("ftctl_"), name


def test_dynamo_histogram_has_dynamos_buckets() -> None:
    """The migration duration histogram has the buckets Dynamo's has (and +Inf)."""
    bounds = metrics.DYNAMO_MIGRATION_DURATION._upper_bounds
    assert tuple(bounds) == (*DYNAMO_DEFAULT_BUCKETS, float("inf"))


def _log_buckets(low: float, high: float, count: int) -> tuple[float, ...]:
    """Dynamo's `generate_log_buckets`: 0, then log-spaced values to two significant figures."""
    out = [0.0]
    for i in range(1, count):
        value = math.exp(math.log(low) + (math.log(high) - math.log(low)) * i / (count - 1))
        rounded = float(f"{value:.2g}")
        if rounded != out[-1]:
            out.append(rounded)
    return tuple(out)


@pytest.mark.parametrize(("histogram", "defaults"), [
    (metrics.DYNAMO_REQUEST_DURATION, (1.0, 512.0, 10)),
    (metrics.DYNAMO_TTFT, (0.001, 480.0, 18)),
    (metrics.DYNAMO_ITL, (0.001, 2.0, 13)),
])
def test_request_histograms_have_dynamos_buckets(histogram: Histogram,
                                                 defaults: tuple[float, float, int]) -> None:
    """The request histograms have Dynamo 1.6's default buckets (and +Inf)."""
    assert tuple(histogram._upper_bounds) == (*_log_buckets(*defaults), float("inf"))


def test_observe_times_is_observe_repeated() -> None:
    """`observe_times(h, v, n)` leaves a histogram as `n` calls of `observe(v)` do."""
    once = Histogram("t_once", "", buckets=(0.1, 1.0), registry=None)
    many = Histogram("t_many", "", buckets=(0.1, 1.0), registry=None)
    for value, times in ((0.05, 3), (0.5, 2), (7.0, 4)):
        metrics.observe_times(once, value, times)
        for _ in range(times):
            many.observe(value)
    (a,), (b,) = once.collect(), many.collect()
    assert [s.value for s in a.samples] == [s.value for s in b.samples]


def test_every_series_is_documented() -> None:
    """docs/metrics.md's table has one row per exported series, and no other."""
    rows = re.findall(r"^\| `([a-z_:]+)` \| (?:counter|gauge|histogram) \|", DOC.read_text(),
                      re.MULTILINE)
    assert sorted(rows) == sorted(metrics.METRIC_NAMES)
