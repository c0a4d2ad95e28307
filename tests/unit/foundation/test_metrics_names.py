"""ftctl's exported series: `ftctl_*` names, Dynamo's names only for mirrors, all documented."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from dynamo_ftctl import metrics

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
# Series exported under Dynamo's exact name and labels (docs/metrics.md, "The Dynamo mirror").
DYNAMO_MIRRORS = {"dynamo_frontend_model_migration_total": ("model", "migration_type")}


def _registered() -> dict[str, tuple[str, ...]]:
    """Each series of metrics.py by its exposed name, with its label names."""
    found: dict[str, tuple[str, ...]] = {}
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        (family,) = collector.describe()
        name = f"{family.name}_total" if family.type == "counter" else family.name
        # prometheus_client shows label names only on samples, and an unused labelled
        # series has none: the wrapper's own record is the one place they are listed.
        found[name] = tuple(collector._labelnames)
    return found


def test_registry_matches_metric_names() -> None:
    """METRIC_NAMES (what the alert test checks against) is exactly what the registry holds."""
    assert set(_registered()) == metrics.METRIC_NAMES


def test_own_series_are_ftctl_and_mirrors_keep_dynamos_labels() -> None:
    """Every series is `ftctl_*` but the Dynamo mirrors, which carry Dynamo's exact labels."""
    for name, labels in _registered().items():
        if name in DYNAMO_MIRRORS:
            assert labels == DYNAMO_MIRRORS[name], name
        else:
            assert name.startswith("ftctl_"), name


def test_every_series_is_documented() -> None:
    """docs/metrics.md's table has one row per exported series, and no other."""
    rows = re.findall(r"^\| `([a-z_:]+)` \| (?:counter|gauge|histogram) \|", DOC.read_text(),
                      re.MULTILINE)
    assert sorted(rows) == sorted(metrics.METRIC_NAMES)
