"""An overload drill overloads at any machine speed: the tier it expects shed is a closed loop
of more users than admission lets in, and the drill's closed-loop users wait out Retry-After."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.drill.method import _load_config
from dynamo_ftctl.drill.scenario import LoadProfile, load_scenario
from dynamo_ftctl.engine.config import resolve_engine_config
from dynamo_ftctl.inventory import Inventory

DRILLS = Path(__file__).resolve().parents[3] / "drills"
SHED_DRILLS = sorted(p for p in DRILLS.glob("*.yaml")
                     if "kind: shed" in p.read_text() and "inventory:" in p.read_text())


def admitted_bound(inventory: Inventory) -> int:
    """The most requests the proxy admits across the sim workers before every one is busy.

    Each admitted request holds at least one KV block from the start (its prompt), and a
    worker whose proxy-side blocks pass `active_decode_blocks_threshold` of its pool is busy.
    """
    threshold = inventory.proxy.busy.active_decode_blocks_threshold
    total = 0
    for worker in inventory.workers:
        assert worker.launch is not None
        assert worker.launch.sim is not None, f"{worker.name}: not a sim worker"
        pool = resolve_engine_config(worker.launch.sim.model_config_name).num_blocks
        total += math.floor(threshold * pool) + 1
    return total


def test_shipped_overload_drills_exist() -> None:
    """The overload drill is among the drills with a shed probe (the check below runs)."""
    assert DRILLS / "overload.yaml" in SHED_DRILLS


@pytest.mark.parametrize("path", SHED_DRILLS, ids=lambda p: p.stem)
def test_the_shed_tier_is_a_closed_loop_beyond_what_admission_admits(path: Path) -> None:
    """A drill that expects a tier shed loads it with a closed loop of more users than the
    proxy admits before every worker is busy (a fixed rate overloads only slow machines:
    60 req/s of best_effort was served in full on an idle 2-core machine)."""
    scenario, inventory = load_scenario(path)
    shed = {e.probe.priority for e in scenario.method.timeline
            if e.probe is not None and e.probe.kind == "shed"}
    for tier in shed:
        users = sum(p.users or 0 for p in scenario.method.profiles if p.priority == tier)
        assert all(p.users is not None for p in scenario.method.profiles if p.priority == tier)
        assert users > admitted_bound(inventory), (tier, users, admitted_bound(inventory))


def test_the_bound_counts_the_sim_pool_and_the_threshold() -> None:
    """overload.yaml's proxy admits at most 21 requests per 1,024-block sim (2%): 63 in all."""
    _, inventory = load_scenario(DRILLS / "overload.yaml")
    assert admitted_bound(inventory) == 63


@given(rate=st.one_of(st.none(), st.floats(min_value=0.1, max_value=1000)),
       users=st.one_of(st.none(), st.integers(min_value=1, max_value=4096)))
def test_a_profile_becomes_an_open_or_a_closed_loop(rate: float | None,
                                                    users: int | None) -> None:
    """A profile with users is a closed loop whose users honor Retry-After; one with a rate
    (or neither: 8 req/s) is an open loop that does not; never both."""
    if rate is not None and users is not None:
        with pytest.raises(ValueError, match="not both"):
            LoadProfile(rate=rate, users=users)
        return
    profile = LoadProfile(rate=rate, users=users, priority="best_effort")
    run = SimpleNamespace(target_url="http://proxy",
                          inventory=SimpleNamespace(workers=[SimpleNamespace(model="m")]))
    schedule = _load_config(run, profile).schedule  # type: ignore[arg-type]
    assert schedule.users == users
    assert schedule.honor_retry_after is (users is not None)
    assert schedule.rate == (None if users is not None else (rate or 8.0))
