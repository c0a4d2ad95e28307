"""A drill's report: the result object, and its JSON, Markdown and PNG timeline files.

matplotlib (the `plot` extra) loads only in `plot_timeline`, with the Agg
backend; without it the report is written without the picture and says so.
Secrets in URLs (an inventory's `user:password@`, `?token=`) are masked in
every form of the report.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.output import redact_doc, to_jsonable
from dynamo_ftctl.redact import redact_text
from dynamo_ftctl.safefiles import write_into

if TYPE_CHECKING:
    from rich.console import RenderableType

    from dynamo_ftctl.drill.state import ProbeOutcome, TimelineEvent

__all__ = [
    "REPORT_FILES",
    "DrillReport",
    "cut_line",
    "placement_text",
    "plot_timeline",
    "render_markdown",
    "witness_line",
    "write_report",
]

# What `write_report` writes into a drill's folder (the picture only with matplotlib).
REPORT_FILES = ("report.json", "report.md", "timeline.png")


@dataclass(frozen=True)
class DrillReport:
    """Everything one drill found; `passed` is the verdict (exit 0, else 1)."""

    scenario: str
    title: str
    local: bool
    passed: bool
    started_at: float
    elapsed_s: float
    error: str | None
    counts: dict[str, Any]
    latency: dict[str, Any]
    probes: tuple[ProbeOutcome, ...]
    events: tuple[TimelineEvent, ...]
    rollbacks: tuple[str, ...]
    states: tuple[tuple[float, str, str], ...]
    out_dir: Path
    # (planned, done, ttft_s, ok, status) per request, seconds since the load began
    records: tuple[tuple[float, float, float | None, bool, int | None], ...] = ()
    files: tuple[str, ...] = ()
    # per injection: seconds until the canary daemon set the worker's weight to 0
    detections: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (`--json`, report.json); per-request rows stay out."""
        return {
            "kind": "ftctl-drill-report", "scenario": self.scenario, "title": self.title,
            "passed": self.passed, "local": self.local, "error": self.error,
            "started_at": self.started_at, "elapsed_s": self.elapsed_s,
            "requests": self.counts, "cut_streams": self.counts.get("cut"),
            "latency": self.latency,
            "probes": to_jsonable(self.probes), "timeline": to_jsonable(self.events),
            "rollbacks": list(self.rollbacks), "worker_downtime_s": self.downtime(),
            "drained_after_s": self.detections,
            "out_dir": str(self.out_dir), "files": list(self.files),
        }

    def downtime(self) -> dict[str, float]:
        """Seconds each worker did not answer /health 200 during the method."""
        out: dict[str, float] = {}
        last: dict[str, tuple[float, str]] = {}
        for t, name, state in self.states:
            if name in last and last[name][1] != "up":
                out[name] = out.get(name, 0.0) + t - last[name][0]
            last[name] = (t, state)
            out.setdefault(name, 0.0)
        return {k: round(v, 3) for k, v in out.items()}

    def summary_lines(self) -> list[str]:
        """The one-screen summary (`ftctl drill`, `make demo`)."""
        c, lat = self.counts, self.latency
        lines = [f"drill {self.title!r}: {'PASSED' if self.passed else 'FAILED'} "
                 f"in {self.elapsed_s:.1f} s"]
        if self.error:
            lines.append(f"  error: {self.error}")
        if c.get("cut"):
            lines.append("  " + cut_line(c["cut"]))
        if c:
            lines.append(f"  requests: sent {c['sent']}, failed {c['failed']}, migrated "
                         f"{c['migrated']}, rejected {c['rejected']}; tokens lost "
                         f"{c['tokens_lost']}, duplicated {c['tokens_duplicated']}")
            if "witness" in c:
                lines.append("  " + witness_line(c["witness"]))
            lines += [f"    {tier}: sent {t['sent']}, failed {t['failed']}, shed {t['rejected']} "
                      f"({t['shed_with_retry_after']} with Retry-After)"
                      for tier, t in c.get("by_priority", {}).items()]
        if lat:
            lines.append(f"  TTFT p50 {_ms(lat.get('ttft_p50_ms'))}, p99 "
                         f"{_ms(lat.get('ttft_p99_ms'))}; p99 before the fault "
                         f"{_ms(lat.get('ttft_p99_before_fault_ms'))}, after "
                         f"{_ms(lat.get('ttft_p99_after_fault_ms'))}")
        lines += [f"  t={e.t_s:6.2f}s  {e.label}: {e.result}" for e in self.events]
        lines += [f"  [{'ok' if p.passed else 'FAIL'}] {p.phase:6} {p.name}: {p.detail}"
                  for p in self.probes]
        lines += [f"  rollback: {r}" for r in self.rollbacks]
        lines += [f"  daemon drained after {label}: "
                  + ("not drained" if v is None else f"{v:.3f} s")
                  for label, v in self.detections.items()]
        down = {k: v for k, v in self.downtime().items() if v}
        if down:
            lines.append("  worker downtime: " + ", ".join(f"{k} {v:.2f} s"
                                                           for k, v in down.items()))
        if self.files:
            lines.append(f"  report: {self.out_dir}/report.md")
        return lines

    def __rich__(self) -> RenderableType:
        from rich.text import Text

        return Text(redact_text("\n".join(self.summary_lines())), no_wrap=True,
                    overflow="ignore")


def cut_line(cut: dict[str, int]) -> str:
    """One sentence on the streams the faults cut mid-generation and how they ended."""
    parts = []
    if cut["witness"]:
        parts.append(f"{cut['witness_token_identical']} of {cut['witness']} witness streams "
                     "token-identical to an uninterrupted run")
    if cut["load"]:
        parts.append(f"{cut['load_complete']} of {cut['load']} load streams complete with "
                     "every token")
    return (f"streams cut mid-generation: {cut['streams']}, continued intact: "
            f"{cut['continued_intact']}" + (f" ({'; '.join(parts)})" if parts else ""))


def witness_line(w: dict[str, Any]) -> str:
    """One sentence on the witness streams: how many were cut and continued intact."""
    line = (f"witness: {w['streams']} greedy streams, {w['failed']} failed, {w['cut']} cut "
            f"and continued, {w['cut_intact']} of those token-identical to the fault-free "
            f"run; {w['ids_mismatched']} differ")
    if w.get("no_reference"):
        line += f" ({w['no_reference']} had no fault-free run)"
    if w.get("first_workers"):
        line += "; first sent to " + placement_text(w["first_workers"])
    return line


def placement_text(counts: dict[str, int]) -> str:
    """Witness streams by worker (`witness.placement`) as "w1 3, w2 3"."""
    return ", ".join(f"{worker} {n}" for worker, n in counts.items())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def render_markdown(report: DrillReport) -> str:
    """The Markdown summary (report.md)."""
    c = report.counts
    out = [f"# Drill: {report.title}", "",
           f"**{'PASSED' if report.passed else 'FAILED'}** — `{report.scenario}`"
           f"{' (local)' if report.local else ''}, {report.elapsed_s:.1f} s", ""]
    if report.error:
        out += [f"Error: `{report.error}`", ""]
    if c.get("cut"):
        out += [f"**{cut_line(c['cut']).capitalize()}.**", ""]
    if c:
        out += ["| requests sent | failed | migrated | rejected | tokens lost | "
                "tokens duplicated |", "|---|---|---|---|---|---|",
                f"| {c['sent']} | {c['failed']} | {c['migrated']} | {c['rejected']} | "
                f"{c['tokens_lost']} | {c['tokens_duplicated']} |", ""]
        if "witness" in c:
            out += [witness_line(c["witness"]) + " (counted in the table above too).", ""]
        if c.get("by_priority"):
            out += ["| priority | sent | completed | failed | shed (503/529) | "
                    "shed with Retry-After | error rate |", "|---|---|---|---|---|---|---|"]
            out += [f"| {tier} | {t['sent']} | {t['completed']} | {t['failed']} | "
                    f"{t['rejected']} | {t['shed_with_retry_after']} | {t['error_rate']:.3f} |"
                    for tier, t in c["by_priority"].items()]
            out.append("")
    if report.latency:
        out += ["| TTFT p50 | TTFT p99 | p99 before fault | p99 after fault |",
                "|---|---|---|---|",
                "| " + " | ".join(_ms(report.latency.get(k)) for k in (
                    "ttft_p50_ms", "ttft_p99_ms", "ttft_p99_before_fault_ms",
                    "ttft_p99_after_fault_ms")) + " |", ""]
    out += ["## Probes", "", "| phase | probe | verdict | detail |", "|---|---|---|---|"]
    out += [f"| {p.phase} | {p.name} | {'ok' if p.passed else 'FAILED'} | {p.detail} |"
            for p in report.probes]
    out += ["", "## Timeline", ""]
    out += [f"- t={e.t_s:.2f} s: {e.label} — {e.result}" for e in report.events]
    out += ["", "## Rollbacks", ""] + [f"- {r}" for r in report.rollbacks]
    if report.detections:
        out += ["", "## Canary daemon", ""]
        out += [f"- {label}: worker drained after "
                + ("— (not drained)" if v is None else f"{v:.3f} s")
                for label, v in report.detections.items()]
    if "timeline.png" in report.files:
        out += ["", "![timeline](timeline.png)"]
    return "\n".join(out) + "\n"


def _bins(report: DrillReport) -> tuple[list[float], list[float], list[float | None],
                                        list[float | None], list[float]]:
    end = max([r[1] for r in report.records] + [s[0] for s in report.states] + [1.0])
    edges = [float(i) for i in range(math.ceil(end) + 1)]
    done: list[float] = []
    p50: list[float | None] = []
    p99: list[float | None] = []
    errors: list[float] = []
    for lo in edges[:-1]:
        in_bin = [r for r in report.records if lo <= r[1] < lo + 1]
        done.append(float(sum(1 for r in in_bin if r[3])))
        errors.append(float(sum(1 for r in in_bin if not r[3])))
        ttfts = sorted(r[2] * 1000 for r in report.records
                       if r[2] is not None and lo <= r[0] < lo + 1)
        p50.append(ttfts[len(ttfts) // 2] if ttfts else None)
        p99.append(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else None)
    return edges[:-1], done, p50, p99, errors


def plot_timeline(report: DrillReport, path: Path) -> None:
    """PNG: throughput, TTFT p50/p99, errors and worker states, with fault markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, done, p50, p99, errors = _bins(report)
    workers = sorted({s[1] for s in report.states})
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(10, 8),
                             gridspec_kw={"height_ratios": [2, 2, 1, 1.2]})
    axes[0].step(xs, done, where="post", label="completed/s")
    axes[0].set_ylabel("req/s")
    axes[1].plot(xs, [v if v is not None else float("nan") for v in p50], label="TTFT p50")
    axes[1].plot(xs, [v if v is not None else float("nan") for v in p99], label="TTFT p99")
    axes[1].set_ylabel("ms")
    axes[1].legend(loc="upper right")
    axes[2].bar(xs, errors, width=0.9, align="edge", color="tab:red")
    axes[2].set_ylabel("errors/s")
    colors = {"up": "tab:green", "down": "tab:red"}
    for row, name in enumerate(workers):
        points = [(t, s) for t, n, s in report.states if n == name]
        for (t, state), nxt in zip(points, [*points[1:], (points[-1][0] + 0.2, "")],
                                   strict=True):
            axes[3].barh(row, nxt[0] - t, left=t, color=colors.get(state, "tab:orange"),
                         height=0.6)
    axes[3].set_yticks(range(len(workers)), workers)
    axes[3].set_xlabel("seconds since the load began")
    for event in report.events:
        if event.label.startswith("probe "):
            continue
        for ax in axes:
            ax.axvline(event.t_s, color="black", linestyle="--", linewidth=1)
        axes[0].annotate(event.label, (event.t_s, 1), xycoords=("data", "axes fraction"),
                         xytext=(3, -12), textcoords="offset points", fontsize=8)
    fig.suptitle(f"{report.title}: {'PASSED' if report.passed else 'FAILED'}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    write_into(path.parent, path.name, png.getvalue())


def write_report(report: DrillReport, *, plot: bool = True) -> DrillReport:
    """Write report.json, report.md and (with matplotlib) timeline.png; return the report."""
    from dynamo_ftctl.output import warn

    files = ["report.json", "report.md"]
    if plot and report.records:
        try:
            plot_timeline(report, report.out_dir / "timeline.png")
            files.append("timeline.png")
        except ImportError:
            warn("matplotlib is not installed (pip install 'dynamo-ftctl[plot]'): no timeline.png")
    report = replace(report, files=tuple(files))
    write_into(report.out_dir, "report.md", redact_text(render_markdown(report)))
    write_into(report.out_dir, "report.json",
               json.dumps(redact_doc(to_jsonable(report.to_json())), indent=2) + "\n")
    return report
