"""The fleet board of `ftctl proxy --procs N`: outcomes replayed into breakers, loads summed."""

from __future__ import annotations

import os

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.proxy.balancer import WorkerSlot
from dynamo_ftctl.proxy.board import FleetBoard, SharedBalancer

WORKERS = ("w0", "w1")


def routers(procs: int = 2, threshold: int = 2) -> tuple[FleetBoard, list[SharedBalancer]]:
    """One board and a `SharedBalancer` per process, as each child has after the fork."""
    board = FleetBoard(procs, WORKERS)
    clock = FakeClock()
    out = []
    for index in range(procs):
        slots = [WorkerSlot(name=n, url=f"http://127.0.0.1:{9000 + i}", group=n, model="m")
                 for i, n in enumerate(WORKERS)]
        out.append(SharedBalancer(slots, board.as_process(index), clock=clock,
                                breaker_threshold=threshold, recovery_s=60.0))
    return board, out


def test_failures_in_one_process_open_the_breaker_in_the_others() -> None:
    """Two failures (the threshold) through process 0 open w0's breaker in 1 and 2 on replay."""
    _, (first, *others) = routers(procs=3)
    for _ in range(2):
        first.record_failure(first.slots["w0"])
    assert first.slots["w0"].breaker == "open"
    for router in others:
        assert router.slots["w0"].breaker == "closed"  # not replayed yet
        router.replay()
        assert router.slots["w0"].breaker == "open"
        assert router.slots["w1"].breaker == "closed"


def test_failures_split_over_processes_add_up() -> None:
    """One failure in each process reaches the threshold of two in both, once replayed."""
    _, (first, second) = routers()
    first.record_failure(first.slots["w0"])
    second.record_failure(second.slots["w0"])
    first.replay()
    second.replay()
    assert first.slots["w0"].breaker == second.slots["w0"].breaker == "open"


def test_the_later_outcome_decides() -> None:
    """Failures then a success elsewhere close the breaker; a success then failures open it."""
    _, (first, second) = routers()
    slot = first.slots["w0"]
    first.record_failure(slot)
    first.record_failure(slot)
    first.record_success(slot)
    second.replay()
    assert second.slots["w0"].breaker == "closed"
    first.record_success(slot)
    first.record_failure(slot)
    first.record_failure(slot)
    second.replay()
    assert second.slots["w0"].breaker == "open"


def test_replayed_outcomes_are_not_posted_again() -> None:
    """A process replaying another's failures writes nothing on its own row (no echo)."""
    board, (first, second) = routers()
    first.record_failure(first.slots["w0"])
    second.replay()
    assert list(board.cells[board.at(1, "w0"):board.at(1, "w0") + 6]) == [0] * 6
    before = first.slots["w0"].consecutive_failures
    first.replay()
    assert first.slots["w0"].consecutive_failures == before


def test_others_load_sums_the_other_rows_and_a_dead_row_is_cleared() -> None:
    """Admission adds what the other processes' requests hold; a dead child's share goes."""
    board, (first, second, _) = routers(procs=3)
    third = board.as_process(2)
    for router, blocks in ((first, 5), (second, 7)):
        router.slots["w1"].kv_blocks = blocks
        router.slots["w1"].pending_prefill_tokens = blocks * 10
        router.post_loads()
    assert third.others_load("w1") == (12, 120)
    assert board.as_process(0).others_load("w1") == (7, 70)
    assert third.others_load("w0") == (0, 0)
    board.clear_row(1)
    assert third.others_load("w1") == (5, 50)


def test_the_board_is_shared_with_a_forked_child() -> None:
    """What a forked child posts, the parent's mapping shows (MAP_SHARED, no file)."""
    board, (first, _) = routers()
    pid = os.fork()
    if pid == 0:  # the child: post one failure, then leave without running pytest's exit
        first.record_failure(first.slots["w1"])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert board.cells[board.at(0, "w1") + 1] == 1  # the failures count of row 0


def test_a_restarted_process_ends_where_the_others_are() -> None:
    """A new router on a used board replays the history (its predecessor's row included) in
    time order at its start: the last outcome wins."""
    board, (first, second) = routers()

    def restarted(index: int) -> SharedBalancer:
        slots = [WorkerSlot(name=n, url="http://127.0.0.1:1", group=n, model="m")
                 for n in WORKERS]
        return SharedBalancer(slots, board.as_process(index), clock=FakeClock(),
                            breaker_threshold=2, recovery_s=60.0)

    for _ in range(2):
        second.record_failure(second.slots["w0"])  # in row 1, by the process now replaced
    assert restarted(1).slots["w0"].breaker == "open"
    first.record_success(first.slots["w0"])  # later, in row 0
    assert restarted(1).slots["w0"].breaker == "closed"
    second.record_failure(second.slots["w0"])
    second.record_failure(second.slots["w0"])  # later still, in row 1
    assert restarted(0).slots["w0"].breaker == "open"
