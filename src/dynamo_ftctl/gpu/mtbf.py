"""`ftctl gpu mtbf`: fleet failure math from an annualised GPU failure rate (AFR).

Model: GPU failures are independent with a constant rate λ = AFR / 8,760 h
(AFR read as failures per GPU-year, the way fleet operators quote it: 3% AFR
on 1,024 GPUs is 30.7 failures a year, one every 285 h). A TP/PP group of g
GPUs fails when any of its GPUs does (rate g·λ), so a request of t seconds on
one group meets a failure with probability 1 - exp(-g·λ·t).

Spare capacity: failed groups come back after `repair_hours`, so the number
down at once is Poisson with mean (groups × g·λ × repair time). The spare
count is the smallest k with P(down ≤ k) ≥ confidence: with k spare groups,
degradation stays at level 0 with that confidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import InvalidInput

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["FleetReliability", "fleet_reliability", "poisson_quantile"]

HOURS_PER_YEAR = 8760.0


def poisson_quantile(mean: float, confidence: float) -> int:
    """The smallest k with P(X ≤ k) ≥ confidence for X ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    log_mean = math.log(mean)
    cdf = 0.0
    k = 0
    # Terms in log space: exp(-mean) alone underflows for means above ~700.
    limit = int(mean + 40 * math.sqrt(mean) + 100)
    while k <= limit:
        cdf += math.exp(-mean + k * log_mean - math.lgamma(k + 1))
        if cdf >= confidence:
            return k
        k += 1
    return limit


@dataclass(frozen=True)
class FleetReliability:
    """Failure figures for a fleet of GPUs split into groups."""

    gpus: int
    afr: float
    group_size: int
    request_seconds: float
    repair_hours: float
    confidence: float
    gpu_failures_per_hour: float
    fleet_failures_per_day: float
    fleet_failures_per_year: float
    fleet_mtbf_hours: float
    groups: int
    group_failures_per_day: float
    group_mtbf_days: float
    request_failure_probability: float
    expected_groups_down: float
    spare_groups: int
    spare_gpus: int
    spare_fraction: float

    def __rich__(self) -> Table:
        from dynamo_ftctl.output import kv_table

        return kv_table(
            f"{self.gpus} GPUs at {self.afr:.2%} AFR, groups of {self.group_size}",
            {
                "fleet MTBF": f"{self.fleet_mtbf_hours:,.1f} h",
                "fleet failures / day": f"{self.fleet_failures_per_day:.3g}",
                "fleet failures / year": f"{self.fleet_failures_per_year:.3g}",
                "groups": self.groups,
                "failures / day per group": f"{self.group_failures_per_day:.3g}",
                "group MTBF": f"{self.group_mtbf_days:,.0f} days",
                f"P(failure) for a {self.request_seconds:g} s request":
                    f"{self.request_failure_probability:.3g}",
                f"groups down at once (mean, {self.repair_hours:g} h repair)":
                    f"{self.expected_groups_down:.3g}",
                f"spare groups for level 0 at {self.confidence:.3%}":
                    f"{self.spare_groups} ({self.spare_gpus} GPUs, "
                    f"{self.spare_fraction:.2%} of the fleet)",
            },
        )


def fleet_reliability(
    *, gpus: int, afr: float, group_size: int = 8, request_seconds: float = 30.0,
    repair_hours: float = 24.0, confidence: float = 0.999,
) -> FleetReliability:
    """Fleet MTBF, failures per day, per-request risk and spare capacity."""
    if gpus < 1:
        raise InvalidInput("--gpus must be at least 1")
    if not 0 < afr <= 1:
        raise InvalidInput(f"--afr is a fraction per year in (0, 1], got {afr} (3% is 0.03)")
    if not 1 <= group_size <= gpus:
        raise InvalidInput(f"--group-size must be between 1 and --gpus ({gpus})")
    if request_seconds <= 0 or repair_hours <= 0:
        raise InvalidInput("--request-seconds and --repair-hours must be positive")
    if not 0 < confidence < 1:
        raise InvalidInput(f"--confidence must be in (0, 1), got {confidence}")
    rate = afr / HOURS_PER_YEAR  # failures per GPU-hour
    fleet_per_hour = gpus * rate
    group_per_hour = group_size * rate
    groups = gpus // group_size
    down = groups * group_per_hour * repair_hours
    spare = poisson_quantile(down, confidence)
    return FleetReliability(
        gpus=gpus, afr=afr, group_size=group_size, request_seconds=request_seconds,
        repair_hours=repair_hours, confidence=confidence,
        gpu_failures_per_hour=rate,
        fleet_failures_per_day=fleet_per_hour * 24,
        fleet_failures_per_year=fleet_per_hour * HOURS_PER_YEAR,
        fleet_mtbf_hours=1 / fleet_per_hour,
        groups=groups,
        group_failures_per_day=group_per_hour * 24,
        group_mtbf_days=1 / group_per_hour / 24,
        request_failure_probability=-math.expm1(-group_per_hour * request_seconds / 3600),
        expected_groups_down=down,
        spare_groups=spare,
        spare_gpus=spare * group_size,
        spare_fraction=spare * group_size / gpus,
    )
