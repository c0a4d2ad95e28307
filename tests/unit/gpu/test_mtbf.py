"""Fleet failure math: the issue's reference figures and the Poisson spare count."""

from __future__ import annotations

import pytest

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.gpu.mtbf import fleet_reliability, poisson_quantile


def test_1024_gpus_at_3_percent() -> None:
    """1,024 GPUs at 3% AFR: fleet MTBF ≈ 285 h; a TP=8 group fails 6.6e-4 times a day."""
    r = fleet_reliability(gpus=1024, afr=0.03, group_size=8)
    assert r.fleet_mtbf_hours == pytest.approx(285.16, abs=0.05)
    assert r.group_failures_per_day == pytest.approx(6.6e-4, rel=0.01)
    assert r.groups == 128


def test_10000_gpus_fail_0_82_times_a_day() -> None:
    """10,000 GPUs at 3% AFR fail 0.82 times a day."""
    r = fleet_reliability(gpus=10_000, afr=0.03)
    assert r.fleet_failures_per_day == pytest.approx(0.822, abs=0.001)
    assert r.fleet_failures_per_year == pytest.approx(300.0)


def test_request_failure_probability() -> None:
    """A 30 s request on 8 GPUs at 3% AFR meets a failure with p = 1 - exp(-8λt)."""
    r = fleet_reliability(gpus=1024, afr=0.03, group_size=8, request_seconds=30)
    assert r.request_failure_probability == pytest.approx(8 * 0.03 / 8760 / 3600 * 30, rel=1e-6)


def test_spares_cover_failures_with_the_given_confidence() -> None:
    """Spare groups are the Poisson quantile of groups down during repairs."""
    r = fleet_reliability(gpus=10_000, afr=0.03, group_size=8, repair_hours=72,
                          confidence=0.999)
    assert r.expected_groups_down == pytest.approx(0.822 * 3, rel=0.01)
    assert r.spare_groups == poisson_quantile(r.expected_groups_down, 0.999)
    assert r.spare_gpus == 8 * r.spare_groups


@pytest.mark.parametrize(
    ("mean", "confidence", "expected"),
    [(0.0, 0.99, 0), (1.0, 0.5, 1), (1.0, 0.99, 4), (2.466, 0.999, 9), (1000.0, 0.5, 1000)],
)
def test_poisson_quantile(mean: float, confidence: float, expected: int) -> None:
    """The quantile matches tabulated Poisson values, large means included."""
    assert poisson_quantile(mean, confidence) == expected


@pytest.mark.parametrize(
    "kwargs",
    [{"gpus": 0, "afr": 0.03}, {"gpus": 8, "afr": 3.0}, {"gpus": 8, "afr": 0.03, "group_size": 16},
     {"gpus": 8, "afr": 0.03, "confidence": 1.0}, {"gpus": 8, "afr": 0.03, "request_seconds": 0}],
)
def test_bad_inputs_are_invalid(kwargs: dict[str, float]) -> None:
    """Out-of-range inputs exit 2 with the flag named."""
    with pytest.raises(InvalidInput, match="--"):
        fleet_reliability(**kwargs)  # type: ignore[arg-type]
