"""Write a report to a directory: summary.json, requests.csv, requests.jsonl, load.png.

Every file is written atomically (temporary name, then rename). matplotlib is
imported only here, with the Agg backend, and only when a plot is asked for.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.safefiles import check_output_dir, check_output_path, write_into

if TYPE_CHECKING:
    from dynamo_ftctl.loadgen.record import RequestRecord
    from dynamo_ftctl.loadgen.runner import LoadReport

__all__ = ["CSV_COLUMNS", "plot_report", "report_paths", "write_report"]

CSV_COLUMNS = (
    "index", "target", "warmup", "outcome", "status", "migrated", "planned_s", "sent_s",
    "first_token_s", "done_s", "queue_ms", "ttft_ms", "ttft_from_sent_ms", "tpot_ms",
    "e2e_ms", "e2e_from_sent_ms", "output_tokens", "error", "server_ttft_ms", "retry_after_s",
)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 4)


def _row(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index, "target": r.target, "warmup": r.warmup, "outcome": r.outcome,
        "status": r.status, "migrated": r.migrated, "planned_s": round(r.planned, 6),
        "sent_s": round(r.sent, 6),
        "first_token_s": None if r.first_token is None else round(r.first_token, 6),
        "done_s": round(r.done, 6), "queue_ms": _ms(r.queue_s), "ttft_ms": _ms(r.ttft_s),
        "ttft_from_sent_ms": _ms(r.ttft_from_sent_s), "tpot_ms": _ms(r.tpot_s),
        "e2e_ms": _ms(r.e2e_s), "e2e_from_sent_ms": _ms(r.e2e_from_sent_s),
        "output_tokens": r.output_tokens, "error": r.error,
        "server_ttft_ms": _ms(r.server_ttft), "retry_after_s": r.retry_after_s,
    }


def report_paths(out: Path, *, plot: bool = True, table: bool = True) -> tuple[Path, ...]:
    """The files `write_report` writes into `out`, checked before a run: `out` is a
    directory or a new path, each file a regular file or a new path (`OutputRefused`)."""
    names = ("summary.json", *(("requests.csv",) if table else ()), "requests.jsonl",
             *(("load.png",) if plot else ()))
    check_output_dir(out)
    for name in names:
        check_output_path(out / name, follow_link=False)  # ftctl named it: no link
    if plot:
        check_plotting()
    return tuple(out / name for name in names)


def check_plotting() -> None:
    """`InvalidInput` (exit 2) when matplotlib is missing: said before a run, not after it."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        msg = "plots need matplotlib: pip install 'dynamo-ftctl[plot]' (or pass --no-plot)"
        raise InvalidInput(msg)


def write_report(report: LoadReport, out: Path, *, plot: bool = True,
                 table: bool = True) -> tuple[Path, ...]:
    """Write the report's files into `out` (created if missing); return their paths.
    `table=False` leaves out requests.csv (the shares of `--procs`: the merge reads
    requests.jsonl only)."""
    paths = report_paths(out, plot=plot, table=table)
    rows = [_row(r) for r in report.records]
    table_text = ""
    if table:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        table_text = buf.getvalue()
    lines = []
    for row, rec in zip(rows, report.records, strict=True):
        row["itl_ms"] = [round(g * 1000.0, 4) for g in rec.itl]
        lines.append(json.dumps(row, separators=(",", ":")))
    # summary.json first: a write that fails (a full disk) fails on it, named, and the
    # previous summary stays whole (tests/unit/foundation/test_output_paths.py).
    write_into(out, "summary.json", json.dumps(report.to_json(), indent=2) + "\n")
    if table:
        write_into(out, "requests.csv", table_text)
    write_into(out, "requests.jsonl", "\n".join(lines) + ("\n" if lines else ""))
    if plot:
        write_into(out, "load.png", plot_report(report))
    return paths


def _per_second(records: tuple[RequestRecord, ...]) -> dict[str, list[float]]:
    """Per 1-second bucket of completion time: counts, tokens and latency percentiles."""
    from dynamo_ftctl.loadgen.stats import percentile

    end = max((r.done for r in records), default=0.0)
    n = max(1, math.ceil(end))
    buckets: list[list[RequestRecord]] = [[] for _ in range(n)]
    for r in records:
        buckets[min(int(r.done), n - 1)].append(r)
    series: dict[str, list[float]] = {k: [] for k in (
        "t", "ok", "failed", "tokens", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")}
    for i, bucket in enumerate(buckets):
        ok = [r for r in bucket if r.ok]
        ttft = sorted(r.ttft_s * 1000 for r in ok if r.ttft_s is not None)
        e2e = sorted(r.e2e_s * 1000 for r in ok)
        series["t"].append(i + 0.5)
        series["ok"].append(len(ok))
        series["failed"].append(len(bucket) - len(ok))
        series["tokens"].append(sum(r.output_tokens for r in ok))
        series["ttft_p50"].append(percentile(ttft, 50))
        series["ttft_p99"].append(percentile(ttft, 99))
        series["e2e_p50"].append(percentile(e2e, 50))
        series["e2e_p99"].append(percentile(e2e, 99))
    return series


def plot_report(report: LoadReport) -> bytes:
    """A PNG: latency percentiles and throughput over time, errors and fault markers."""
    try:
        import matplotlib as mpl
    except ImportError:
        msg = "plots need matplotlib: pip install 'dynamo-ftctl[plot]' (or pass --no-plot)"
        raise InvalidInput(msg) from None
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    s = _per_second(report.records)
    fig, (lat, thr) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    try:
        lat.plot(s["t"], s["ttft_p50"], label="TTFT p50")
        lat.plot(s["t"], s["ttft_p99"], label="TTFT p99")
        lat.plot(s["t"], s["e2e_p50"], label="e2e p50", linestyle="--")
        lat.plot(s["t"], s["e2e_p99"], label="e2e p99", linestyle="--")
        lat.set_ylabel("latency from planned send (ms)")
        lat.set_yscale("log")
        lat.legend(loc="upper left", fontsize="small")
        thr.plot(s["t"], s["ok"], label="completed req/s", color="tab:green")
        thr.set_ylabel("requests/s")
        err_t = [t for t, f in zip(s["t"], s["failed"], strict=True) if f]
        err_n = [f for f in s["failed"] if f]
        if err_t:
            thr.scatter(err_t, err_n, color="tab:red", marker="x", label="failed/s", zorder=3)
        tok = thr.twinx()
        tok.plot(s["t"], s["tokens"], color="tab:purple", alpha=0.6, label="tokens/s")
        tok.set_ylabel("output tokens/s")
        thr.legend(loc="upper left", fontsize="small")
        thr.set_xlabel("seconds since start")
        for axis in (lat, thr):
            if report.config.warmup_s:
                axis.axvspan(0, report.config.warmup_s, color="0.9", zorder=0)
            for t, _label in report.markers:
                axis.axvline(t, color="tab:red", linestyle=":", linewidth=1)
        for t, label in report.markers:
            lat.annotate(label, (t, 1.0), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize="small",
                         color="tab:red")
        fig.suptitle(f"ftctl load: {', '.join(report.config.targets)}", fontsize="medium")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        return png.getvalue()
    finally:
        plt.close(fig)
