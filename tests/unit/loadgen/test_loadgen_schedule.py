"""Arrival plans: bounded, seeded, at the asked rate and shape."""

from __future__ import annotations

import itertools
import statistics

import pytest

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.loadgen.config import Schedule
from dynamo_ftctl.loadgen.schedule import plan_arrivals, rate_at, trace_offsets


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_constant_plan_is_evenly_spaced_and_bounded_by_duration():
    """A constant 50/s for 2 s plans exactly 100 sends, 20 ms apart, starting at 0."""
    plan = plan_arrivals(Schedule(rate=50, arrival="constant"), duration_s=2.0, count=None)
    assert len(plan) == 100
    assert plan[0] == 0.0
    assert all(g == pytest.approx(0.02) for g in _gaps(plan))


def test_count_bounds_a_plan():
    """A count stops the plan even when the duration would allow more."""
    plan = plan_arrivals(Schedule(rate=1000), duration_s=60.0, count=7)
    assert len(plan) == 7


def test_poisson_plan_has_the_rate_and_is_seeded():
    """Poisson gaps average 1/rate with a coefficient of variation near 1; same seed, same plan."""
    sched = Schedule(rate=100, arrival="poisson", seed=3)
    plan = plan_arrivals(sched, duration_s=None, count=20000)
    gaps = _gaps(plan)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.01, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)
    assert plan == plan_arrivals(sched, duration_s=None, count=20000)
    assert plan != plan_arrivals(Schedule(rate=100, seed=4), duration_s=None, count=20000)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_spread(burstiness):
    """Gamma gaps keep the mean 1/rate; their squared CV is 1/burstiness (vLLM's convention)."""
    plan = plan_arrivals(Schedule(rate=50, arrival="gamma", burstiness=burstiness, seed=1),
                         duration_s=None, count=20000)
    gaps = _gaps(plan)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.02, rel=0.05)
    cv2 = (statistics.pstdev(gaps) / mean) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_linear_ramp_raises_the_rate_over_the_duration():
    """A 10 s ramp from 10/s to 100/s sends ~14.5 in its first second and ~95.5 in its last."""
    sched = Schedule(rate=10, ramp_to=100, arrival="constant")
    plan = plan_arrivals(sched, duration_s=10.0, count=None)
    first = sum(1 for t in plan if t < 1)
    last = sum(1 for t in plan if t >= 9)
    assert 13 <= first <= 16
    assert 93 <= last <= 97
    assert rate_at(sched, 5.0, 10.0) == pytest.approx(55)


def test_step_ramp_holds_each_step():
    """Four steps from 10 to 40/s hold 10, 20, 30, 40 for a quarter of the run each."""
    sched = Schedule(rate=10, ramp_to=40, ramp_steps=4)
    assert [rate_at(sched, t, 8.0) for t in (0.5, 2.5, 4.5, 7.9)] == [10, 20, 30, 40]


def test_trace_offsets_start_at_zero():
    """A trace's timestamps become offsets from its first request."""
    assert trace_offsets([100.0, 100.5, 103.0]) == [0.0, 0.5, 3.0]


def test_schedule_refuses_nonsense():
    """Neither or both of rate and users, or a non-positive rate, is invalid input (exit 2)."""
    with pytest.raises(InvalidInput):
        Schedule()
    with pytest.raises(InvalidInput):
        Schedule(rate=1, users=1)
    with pytest.raises(InvalidInput):
        Schedule(rate=0)
    with pytest.raises(InvalidInput):
        Schedule(users=2, ramp_to=10)
