"""Tokens that cannot go back (issue 30, case 2): the fencing token is a hybrid logical
clock, the wall clock's milliseconds << 16 plus a counter, never below the token floor.

What it survives, each claim a test below: a reboot (nothing but the files and the wall
clock count); deleting the lock file, the floor, or both; the wall clock stepping back
while the floor survives. What it does not: deleting both files *and* the wall clock
reading earlier than at the last token; the settle wait on a new lock file covers steps
back shorter than itself.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.clock import FakeClock
from dynamo_ftctl.lock import FlockLock
from dynamo_ftctl.lock.owner import COUNTER_BITS, clock_token, floor_path

WALL = 1_764_000_000.0  # 2025-11-24, a wall clock reading for the fake clock


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "failover.lock"


def take(path: Path, clock: FakeClock, settle_s: float = 0.0) -> int:
    """One acquisition and release by a new lock object (a new process, as far as the
    token is concerned) on `clock`; its token."""
    lock = FlockLock(path, clock=clock, watch_interval_s=0, settle_s=settle_s)
    token = lock.acquire(5).token
    lock.release()
    return token


def wipe(path: Path) -> None:
    """`rm -f P P.floor`."""
    path.unlink(missing_ok=True)
    floor_path(path).unlink(missing_ok=True)


def test_first_token_is_the_wall_clocks_milliseconds_shifted() -> None:
    """clock_token is the wall clock's milliseconds above 16 counter bits."""
    assert COUNTER_BITS == 16
    assert clock_token(WALL) == int(WALL * 1000) << 16
    assert clock_token(-5.0) == 0  # a clock before the epoch gives the floor's word alone


def test_tokens_follow_the_clock_and_count_within_a_millisecond(lock_path: Path) -> None:
    """The first token is the clock's; within one millisecond the counter adds one; a later
    millisecond starts from the clock again."""
    clock = FakeClock(wall_start=WALL)
    first = take(lock_path, clock)
    assert first == clock_token(WALL)
    assert take(lock_path, clock) == first + 1
    clock.advance(0.002)
    assert take(lock_path, clock) == clock_token(clock.wall())


def test_a_reboot_keeps_the_sequence(lock_path: Path) -> None:
    """After a reboot (the monotonic clock starts again at 0, memory is gone) the next token
    is above the last: it comes from the floor on disk and the wall clock only."""
    before = take(lock_path, FakeClock(start=5000.0, wall_start=WALL))
    rebooted = FakeClock(start=0.0, wall_start=WALL + 30)
    assert take(lock_path, rebooted) > before


@pytest.mark.parametrize("deleted", ["P", "P.floor", "both"])
def test_deleting_the_files_never_lowers_the_token(lock_path: Path, deleted: str) -> None:
    """The lock file, its floor, or both deleted between two acquisitions a millisecond
    apart: the next token is still higher (both: the clock's milliseconds are later)."""
    clock = FakeClock(wall_start=WALL)
    last = take(lock_path, clock)
    last = take(lock_path, clock)  # the counter is used: last = clock token + 1
    if deleted in {"P", "both"}:
        lock_path.unlink()
    if deleted in {"P.floor", "both"}:
        floor_path(lock_path).unlink()
    clock.advance(0.001)
    assert take(lock_path, clock) > last


def test_clock_stepped_back_with_the_floor_keeps_rising(lock_path: Path) -> None:
    """The wall clock stepped back an hour: the floor keeps the tokens rising, one above
    the last, until the clock catches up."""
    clock = FakeClock(wall_start=WALL)
    last = take(lock_path, clock)
    clock.step_wall(-3600)
    assert take(lock_path, clock) == last + 1
    lock_path.unlink()  # the lock file alone deleted: the floor still counts
    assert take(lock_path, clock) == last + 2


def test_clock_stepped_back_and_both_files_deleted_can_go_back(lock_path: Path) -> None:
    """The documented limit: with both files deleted and the wall clock an hour earlier than
    at the last token, the next token is lower (nothing is left that knew the last one)."""
    clock = FakeClock(wall_start=WALL)
    last = take(lock_path, clock)
    wipe(lock_path)
    clock.step_wall(-3600)
    assert take(lock_path, clock) < last


def test_the_settle_wait_covers_a_step_back_shorter_than_itself(lock_path: Path) -> None:
    """Both files deleted and the clock stepped back 5 s: the new lock file's settle wait
    (6 s with the defaults) is on the same wall clock, so the token is still higher."""
    clock = FakeClock(wall_start=WALL)
    last = take(lock_path, clock, settle_s=6.0)
    wipe(lock_path)
    clock.step_wall(-5.0)
    assert take(lock_path, clock, settle_s=6.0) > last


# One step of the property test: acquire, let time pass, step the wall clock back, or
# delete or replace files.
STEPS = st.one_of(
    st.just(("acquire", 0.0)),
    st.tuples(st.just("advance"), st.floats(0.0005, 100.0)),
    st.tuples(st.just("step back"), st.floats(0.0, 7200.0)),
    st.tuples(st.sampled_from(["rm P", "rm floor", "rm both", "mv over P"]), st.just(0.0)),
)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(STEPS, min_size=1, max_size=25))
def test_tokens_rise_unless_both_files_and_the_clock_went_back(
        steps: list[tuple[str, float]]) -> None:
    """Over any sequence of acquisitions, deletions, replacements and clock steps (no settle
    wait, so the clock stands still across a wipe): a token is above the last one whenever
    the floor survived since it, and above every earlier one when the wall clock reads a
    later millisecond than at every earlier acquisition, or when no acquisition ever met
    the documented limit (both files deleted, the clock not later: the sequence may
    repeat from there on)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "P"
        clock = FakeClock(wall_start=WALL)
        highest, latest_ms, last, limited = 0, -1, 0, False
        for step, amount in steps:
            if step == "advance":
                clock.advance(amount)
            elif step == "step back":
                clock.step_wall(-amount)
            elif step in {"rm P", "rm both"}:
                path.unlink(missing_ok=True)
            if step in {"rm floor", "rm both"}:
                floor_path(path).unlink(missing_ok=True)
            if step == "mv over P":
                (Path(folder) / "incoming").write_text('{"token": 1}\n')
                (Path(folder) / "incoming").rename(path)
            if step != "acquire":
                continue
            floor_kept = floor_path(path).exists()
            now_ms = int(clock.wall() * 1000)
            limited = limited or (not floor_kept and now_ms <= latest_ms)
            token = take(path, clock)
            if floor_kept:
                assert token > last, (step, token, last)
            if now_ms > latest_ms or not limited:
                assert token > highest, (step, token, highest)
            highest, latest_ms, last = max(highest, token), max(latest_ms, now_ms), token
