"""Find the highest open-loop rate that meets an SLO, by bisection.

Each step is a full bounded run (same duration/count, warm-up and workload)
at one rate; the search keeps the highest rate that met the SLO and the
lowest that did not, and stops when they are within `precision` of each
other or after `max_steps` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.loadgen.config import LoadConfig
from dynamo_ftctl.loadgen.runner import LoadEvent, Sender, run_in_fast_loop, run_load_async
from dynamo_ftctl.loadgen.stats import LoadSummary

__all__ = ["SweepReport", "SweepStep", "sweep_rate", "sweep_rate_async"]


@dataclass(frozen=True)
class SweepStep:
    """One run of the sweep."""

    rate_per_s: float
    slo_met: bool
    summary: LoadSummary


@dataclass(frozen=True)
class SweepReport:
    """The sweep's answer: the highest rate that met the SLO (None: not even the lowest)."""

    best_rate_per_s: float | None
    lowest_failing_rate_per_s: float | None
    steps: tuple[SweepStep, ...]
    slo: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        from dynamo_ftctl.output import to_jsonable

        return {
            "kind": "ftctl-load-sweep",
            "best_rate_per_s": self.best_rate_per_s,
            "lowest_failing_rate_per_s": self.lowest_failing_rate_per_s,
            "slo": self.slo,
            "steps": [{"rate_per_s": s.rate_per_s, "slo_met": s.slo_met,
                       "requests_per_s": s.summary.requests_per_s,
                       "error_rate": s.summary.error_rate,
                       "ttft_p99_ms": s.summary.ttft_ms.p99,
                       "itl_p99_ms": s.summary.itl_ms.p99,
                       "summary": to_jsonable(s.summary)} for s in self.steps],
        }

    def __rich__(self) -> Any:
        from dynamo_ftctl.output import table

        rows = [(f"{s.rate_per_s:,.2f}", "yes" if s.slo_met else "no",
                 f"{s.summary.requests_per_s:,.2f}", f"{s.summary.ttft_ms.p99:,.2f}",
                 f"{s.summary.itl_ms.p99:,.2f}", f"{s.summary.error_rate:.2%}")
                for s in self.steps]
        best = "none" if self.best_rate_per_s is None else f"{self.best_rate_per_s:,.2f}/s"
        return table(f"sweep: highest rate meeting the SLO = {best}",
                     ["rate/s", "SLO met", "achieved/s", "ttft p99 ms", "itl p99 ms",
                      "errors"], rows)


async def sweep_rate_async(
    config: LoadConfig, *, low: float, high: float, precision: float = 0.05,
    max_steps: int = 8, on_step: Callable[[SweepStep], None] | None = None,
    on_event: Callable[[LoadEvent], None] | None = None, sender: Sender | None = None,
) -> SweepReport:
    """Bisect the rate in [low, high] for the highest one meeting `config.slo`."""
    if config.slo.empty:
        msg = "sweep: give an SLO (--slo-ttft, --slo-itl and/or --slo-error-rate)"
        raise InvalidInput(msg)
    if not 0 < low < high:
        msg = f"sweep: need 0 < low < high, got {low}:{high}"
        raise InvalidInput(msg)
    if not config.schedule.open_loop:
        msg = "sweep: searches an open-loop rate; give --rate semantics, not --users"
        raise InvalidInput(msg)
    steps: list[SweepStep] = []

    async def trial(rate: float) -> bool:
        cfg = replace(config, schedule=replace(config.schedule, rate=rate, ramp_to=None))
        report = await run_load_async(cfg, on_event=on_event, sender=sender)
        met = bool(report.summary.slo_met)
        step = SweepStep(rate, met, report.summary)
        steps.append(step)
        if on_step is not None:
            on_step(step)
        return met

    good: float | None = None
    bad: float | None = None
    if await trial(high):
        good = high
    elif not await trial(low):
        bad = low
    else:
        good, bad = low, high
        while len(steps) < max_steps and (bad - good) > precision * bad:
            mid = (good + bad) / 2
            if await trial(mid):
                good = mid
            else:
                bad = mid
    return SweepReport(best_rate_per_s=good, lowest_failing_rate_per_s=bad,
                       steps=tuple(steps),
                       slo={"ttft_p99_ms": config.slo.ttft_p99_ms,
                            "itl_p99_ms": config.slo.itl_p99_ms,
                            "error_rate": config.slo.error_rate})


def sweep_rate(config: LoadConfig, *, low: float, high: float, precision: float = 0.05,
               max_steps: int = 8, on_step: Callable[[SweepStep], None] | None = None,
               ) -> SweepReport:
    """`sweep_rate_async` in a new event loop (uvloop when installed, as `run_load`)."""
    return run_in_fast_loop(sweep_rate_async(config, low=low, high=high, precision=precision,
                                        max_steps=max_steps, on_step=on_step))
