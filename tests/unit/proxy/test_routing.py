"""Routing: least outstanding weighted by health, exclusions, breaker on a fake clock."""

from __future__ import annotations

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.proxy.balancer import Balancer, WorkerSlot, parse_daemon_weights


def make(clock: FakeClock, groups: tuple[str, ...] = ("a", "b", "c")) -> Balancer:
    slots = [WorkerSlot(name=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", group=g, model="m")
             for i, g in enumerate(groups)]
    return Balancer(slots, clock=clock, breaker_threshold=3, recovery_s=60.0)


def test_least_outstanding_worker_is_picked() -> None:
    """The worker with the fewest outstanding requests wins."""
    router = make(FakeClock())
    router.slots["w0"].outstanding = 2
    router.slots["w1"].outstanding = 0
    router.slots["w2"].outstanding = 1
    assert router.pick().name == "w1"  # type: ignore[union-attr]


def test_equal_workers_share_the_load_round_robin() -> None:
    """Ties rotate so that idle workers all get traffic."""
    router = make(FakeClock())
    assert {router.pick().name for _ in range(3)} == {"w0", "w1", "w2"}  # type: ignore[union-attr]


def test_failed_worker_and_group_are_excluded() -> None:
    """A continuation never goes to the failed worker nor to its group."""
    router = make(FakeClock(), groups=("a", "a", "b"))
    for _ in range(5):
        slot = router.pick(exclude_workers={"w0"}, exclude_groups={"a"})
        assert slot is not None
        assert slot.name == "w2"
    assert router.pick(exclude_workers={"w2"}, exclude_groups={"a", "b"}) is None


def test_breaker_opens_after_threshold_and_recovers_through_one_trial() -> None:
    """3 consecutive failures open the breaker; after 60 s one trial; success closes it."""
    clock = FakeClock()
    router = make(clock, groups=("a",))
    slot = router.slots["w0"]
    for _ in range(3):
        router.record_failure(slot)
    assert slot.breaker == "open"
    assert router.pick() is None
    assert router.pick(last_resort=True) is slot
    clock.advance(60.0)
    trial = router.pick()
    assert trial is slot
    assert slot.breaker == "half_open"
    assert router.pick() is None  # one trial at a time
    router.record_success(slot)
    assert slot.breaker == "closed"
    assert router.weight(slot) == 1.0


def on_trial(clock: FakeClock) -> tuple[Balancer, WorkerSlot]:
    """A one-worker router whose breaker opened, then let its one trial request out."""
    router = make(clock, groups=("a",))
    slot = router.slots["w0"]
    for _ in range(3):
        router.record_failure(slot)
    clock.advance(61.0)
    assert router.pick() is slot
    return router, slot


def test_half_open_failure_reopens_at_once() -> None:
    """A failed trial opens the breaker again for another recovery period."""
    router, slot = on_trial(FakeClock())
    router.record_failure(slot)
    assert slot.breaker == "open"
    assert router.healthy_capacity() == 0.0


def test_a_neutral_trial_lets_the_next_request_try() -> None:
    """A trial that failed through its request (a query of death) leaves the breaker
    half-open with its trial slot free again, counting neither success nor failure."""
    router, slot = on_trial(FakeClock())
    assert router.pick() is None  # its trial is out
    router.record_neutral(slot)
    assert (slot.breaker, slot.failures, slot.successes) == ("half_open", 3, 0)
    assert router.pick() is slot


def test_success_resets_consecutive_failures() -> None:
    """Failures that are not consecutive never open the breaker."""
    router = make(FakeClock(), groups=("a",))
    slot = router.slots["w0"]
    for _ in range(5):
        router.record_failure(slot)
        router.record_failure(slot)
        router.record_success(slot)
    assert slot.breaker == "closed"


def test_daemon_weights_steer_routing_and_capacity() -> None:
    """SUSPICIOUS halves a worker's weight; UNHEALTHY removes it from routing."""
    router = make(FakeClock())
    router.apply_daemon_weights(parse_daemon_weights({"workers": [
        {"name": "w0", "state": "HEALTHY"}, {"name": "w1", "state": "suspicious"},
        {"name": "w2", "state": "unhealthy"}]}))
    assert router.healthy_capacity() == 0.5
    router.slots["w0"].outstanding = 1  # (1+1)/1 = 2 vs (0+1)/0.5 = 2: a tie
    router.slots["w1"].outstanding = 1  # (1+1)/0.5 = 4: w0 wins
    assert router.pick().name == "w0"  # type: ignore[union-attr]
    assert all(s.name != "w2" for s in router.routable())


def test_daemon_weight_formats() -> None:
    """Lists, mappings of states and bare numbers are all read; bad entries are skipped."""
    assert parse_daemon_weights([{"worker": "a", "weight": 0.5}]) == {"a": 0.5}
    assert parse_daemon_weights({"a": {"state": "DEAD"}, "b": 2, "c": "x"}) == {"a": 0.0, "b": 1.0}


def test_busy_workers_are_avoided_but_not_refused() -> None:
    """A non-busy worker wins over a less loaded busy one; with all busy the least loaded busy one."""
    router = make(FakeClock())
    router.slots["w0"].busy = True
    router.slots["w1"].busy = True
    router.slots["w1"].outstanding = 0
    router.slots["w2"].outstanding = 5
    assert router.pick().name == "w2"  # type: ignore[union-attr]
    router.slots["w2"].busy = True
    router.slots["w0"].outstanding = 3
    assert router.pick().name == "w1"  # type: ignore[union-attr]
    router.slots["w1"].busy = False
    assert router.pick(exclude_workers={"w1"}).name == "w0"  # type: ignore[union-attr]
