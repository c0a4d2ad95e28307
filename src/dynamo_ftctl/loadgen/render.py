"""Rich renderings of load results for people (the JSON form is `LoadReport.to_json`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo_ftctl.loadgen.runner import LoadReport, Progress
    from dynamo_ftctl.loadgen.stats import Distribution

__all__ = ["render_progress", "render_report"]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.2f}"  # NaN: no samples


def render_report(report: LoadReport) -> Any:
    """Throughput, counts and latency percentiles as rich tables."""
    from rich.console import Group

    from dynamo_ftctl.output import kv_table, table

    s = report.summary
    head: dict[str, Any] = {
        "targets": ", ".join(report.config.targets),
        "window_s": round(s.window_s, 3),
        "requests_per_s": round(s.requests_per_s, 2),
        "output_tokens_per_s": round(s.output_tokens_per_s, 1),
        "completed": s.completed,
        "failed": s.failed,
        "migrated": s.migrated,
        "errors_by_class": s.errors_by_class or "-",
    }
    if report.server_metrics:
        from dynamo_ftctl.loadgen.servermetrics import server_migrations

        counted = server_migrations(report.server_metrics)
        head["migrated (server counters)"] = "-" if counted is None else _count(counted)
    if s.goodput_requests_per_s is not None:
        head["goodput_requests_per_s"] = round(s.goodput_requests_per_s, 2)
        head["slo_met"] = s.slo_met
    if report.aborted:
        head["aborted"] = report.aborted
    dists: list[tuple[str, Distribution]] = [
        ("ttft (from planned)", s.ttft_ms), ("ttft (from sent)", s.ttft_from_sent_ms),
        ("itl", s.itl_ms), ("tpot", s.tpot_ms), ("e2e (from planned)", s.e2e_ms),
        ("e2e (from sent)", s.e2e_from_sent_ms), ("queue (planned→sent)", s.queue_ms),
    ]
    rows = [(name, d.count, _ms(d.p50), _ms(d.p90), _ms(d.p95), _ms(d.p99), _ms(d.p99_9),
             _ms(d.max)) for name, d in dists]
    parts = [
        kv_table("ftctl load", head),
        table("latency (ms)", ["metric", "n", "p50", "p90", "p95", "p99", "p99.9", "max"],
              rows, styles={"metric": "bold"}),
    ]
    if report.server_metrics:
        parts.append(_server_table(report))
    return Group(*parts)


def _count(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value == int(value) else f"{value:,.3f}"


def _server_table(report: LoadReport) -> Any:
    """The targets' own counters over the run, one row per family (labels summed)."""
    from dynamo_ftctl.output import table
    from dynamo_ftctl.redact import redact_url

    rows: list[tuple[str, ...]] = []
    for server in report.server_metrics:
        url = redact_url(server.url)
        if server.error:
            rows.append((url, f"scrape failed: {server.error}", "", "-", "-", "-"))
        elif not server.counters:
            rows.append((url, "no counters of interest", "", "-", "-", "-"))
        for c in server.counters:
            delta = "reset" if c.delta is None and c.after is not None else _count(c.delta)
            rows.append((url, c.name, c.source, _count(c.before), _count(c.after), delta))
    return table("server counters over the run (summed over labels)",
                 ["metrics url", "counter", "source", "before", "after", "delta"], rows,
                 styles={"counter": "bold"})


def render_progress(progress: Progress, *, planned: int | None) -> str:
    """One status line, labelled as ftctl load's: elapsed time, requests sent, done, failed
    and in flight, the recent rate and p99 TTFT."""
    total = f"/{planned}" if planned else ""
    ttft = "-" if progress.ttft_p99_ms is None else f"{progress.ttft_p99_ms:,.0f} ms"
    return (f"ftctl load {progress.t:.1f}s: sent {progress.sent}{total}, "
            f"done {progress.completed}, failed {progress.failed}, "
            f"in flight {progress.in_flight}, {progress.completed_per_s:,.1f} req/s, "
            f"p99 TTFT {ttft}")
