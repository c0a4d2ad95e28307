"""Arrival plans: the planned send times of an open-loop run, computed before it starts.

Planning ahead is what keeps the generator honest: a request's latency is
measured from the time it *should* have been sent, so a server that stalls
cannot slow the arrivals down and hide its own latency (coordinated omission).
Plans are deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from dynamo_ftctl.loadgen.config import Schedule

__all__ = ["plan_arrivals", "rate_at", "trace_offsets"]

# A safety net for plans without a count: at most this many arrivals.
_MAX_ARRIVALS = 10_000_000


def rate_at(schedule: Schedule, t: float, duration_s: float | None) -> float:
    """The planned rate (requests/s) at `t` seconds into the run."""
    assert schedule.rate is not None
    if schedule.ramp_to is None or not duration_s:
        return schedule.rate
    frac = min(max(t / duration_s, 0.0), 1.0)
    if schedule.ramp_steps > 0:
        # Equal steps from `rate` to `ramp_to`, the first at `rate`, the last at `ramp_to`.
        step = min(int(frac * schedule.ramp_steps), schedule.ramp_steps - 1)
        span = max(schedule.ramp_steps - 1, 1)
        frac = step / span if schedule.ramp_steps > 1 else 0.0
    return schedule.rate + (schedule.ramp_to - schedule.rate) * frac


def plan_arrivals(
    schedule: Schedule, *, duration_s: float | None, count: int | None,
) -> list[float]:
    """Planned send offsets (seconds from the start), ascending, bounded by duration/count."""
    if schedule.rate is None:
        msg = "a closed-loop schedule has no planned arrivals"
        raise ValueError(msg)
    if duration_s is None and count is None:
        msg = "an arrival plan needs a duration or a count"
        raise ValueError(msg)
    rng = random.Random(schedule.seed)
    limit = min(count if count is not None else _MAX_ARRIVALS, _MAX_ARRIVALS)
    shape = schedule.burstiness
    out: list[float] = []
    # The first request goes at t=0; each later one after a gap drawn at the current rate.
    t = 0.0
    # Summed gaps drift by rounding (400 gaps of 1/200 add up to just under 2.0).
    end = None if duration_s is None else duration_s - 1e-9
    while len(out) < limit:
        if end is not None and t >= end:
            break
        out.append(t)
        rate = rate_at(schedule, t, duration_s)
        if schedule.arrival == "constant":
            gap = 1.0 / rate
        elif schedule.arrival == "poisson":
            gap = rng.expovariate(rate)
        else:  # gamma with mean 1/rate: shape k = burstiness, scale = 1/(rate k)
            gap = rng.gammavariate(shape, 1.0 / (rate * shape))
        t += gap
    return out


def trace_offsets(timestamps: Sequence[float]) -> list[float]:
    """Offsets of a replayed trace (timestamps in order) shifted to start at zero."""
    if not timestamps:
        return []
    first = timestamps[0]
    return [ts - first for ts in timestamps]
