"""Compare two load reports (`summary.json` or `--json` output): what changed, by how much."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_ftctl.documents import load_json_file
from dynamo_ftctl.errors import InventoryError

__all__ = ["Comparison", "MetricDelta", "compare_reports", "load_report_json"]

# A summary is a few KiB (per-request rows go to requests.jsonl); 16 MiB is no report.
_MAX_REPORT_BYTES = 16 * 1024 * 1024

# (key path, higher is better)
_METRICS: tuple[tuple[str, bool], ...] = (
    ("requests_per_s", True),
    ("output_tokens_per_s", True),
    ("goodput_requests_per_s", True),
    ("completed", True),
    ("failed", False),
    ("error_rate", False),
    ("migrated", False),
    *((f"{name}.{p}", False)
      for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms")
      for p in ("p50", "p90", "p99", "p99_9", "max")),
)


@dataclass(frozen=True)
class MetricDelta:
    """One metric in both reports; `change` is relative (B / A - 1), `better` its sense."""

    metric: str
    a: float | None
    b: float | None
    change: float | None
    better: bool | None


@dataclass(frozen=True)
class Comparison:
    """The differences between report A and report B."""

    a: str
    b: str
    metrics: tuple[MetricDelta, ...]
    errors_by_class: dict[str, tuple[int, int]]

    def __rich__(self) -> Any:
        from dynamo_ftctl.output import table

        def cell(v: float | None) -> str:
            return "-" if v is None else f"{v:,.4g}"

        rows = []
        for m in self.metrics:
            change = "-" if m.change is None else f"{m.change:+.1%}"
            verdict = {True: "better", False: "worse", None: ""}[m.better]
            rows.append((m.metric, cell(m.a), cell(m.b), change, verdict))
        for name, (ea, eb) in self.errors_by_class.items():
            rows.append((f"errors.{name}", str(ea), str(eb), f"{eb - ea:+d}",
                         "better" if eb < ea else ("worse" if eb > ea else "")))
        return table(f"A = {self.a}   B = {self.b}", ["metric", "A", "B", "change", ""],
                     rows, styles={"metric": "bold"})


def load_report_json(path: Path) -> dict[str, Any]:
    """Read a load report JSON; InvalidInput (exit 2) names the file when it is not one."""
    doc = load_json_file(path, limit=_MAX_REPORT_BYTES, what="a load report (JSON)")
    if not isinstance(doc, dict) or doc.get("kind") != "ftctl-load-report":
        raise InventoryError("not an ftctl load report (kind: ftctl-load-report)", path=path,
                             key="kind")
    return doc


def _get(doc: dict[str, Any], dotted: str) -> float | None:
    value: Any = doc
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def compare_reports(path_a: Path, path_b: Path) -> Comparison:
    """Compare two saved reports metric by metric."""
    a, b = load_report_json(path_a), load_report_json(path_b)
    deltas = []
    for metric, higher_better in _METRICS:
        va, vb = _get(a, metric), _get(b, metric)
        if va is None and vb is None:
            continue
        change = None
        better = None
        if va is not None and vb is not None:
            if va != 0:
                change = vb / va - 1.0
            if vb != va:
                better = (vb > va) == higher_better
        deltas.append(MetricDelta(metric, va, vb, change, better))
    ea = a.get("errors_by_class") or {}
    eb = b.get("errors_by_class") or {}
    errors = {k: (int(ea.get(k, 0)), int(eb.get(k, 0))) for k in sorted({*ea, *eb})}
    return Comparison(str(path_a), str(path_b), tuple(deltas), errors)
