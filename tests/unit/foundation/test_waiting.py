"""The suite's one way to wait (tests/waiting.py): the value that ended the wait, or a
failure naming what was awaited and the last value seen."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import until, wait_until


def test_wait_until_returns_the_value_that_ended_the_wait() -> None:
    """The check's first accepted value is returned; earlier ones were polled past."""
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 30, "three polls", accept=lambda n: n >= 3,
                      interval=0) == 3


def test_wait_until_names_what_and_the_last_value_at_the_timeout() -> None:
    """A condition that never holds fails naming `what` and what the check last returned."""
    with pytest.raises(AssertionError, match=r"waiting for the gauge at 5; last seen: 4"):
        wait_until(lambda: 4, 0.05, "the gauge at 5", accept=lambda n: n == 5, interval=0.01)


def test_ignored_exceptions_are_not_yet_and_show_as_the_last_value() -> None:
    """An exception listed in `ignore` means "not yet"; others end the wait at once."""
    tries = itertools.count()

    def refused_twice() -> str:
        if next(tries) < 2:
            raise ConnectionRefusedError
        return "up"

    assert wait_until(refused_twice, 30, "the port", ignore=(ConnectionRefusedError,),
                      interval=0) == "up"
    with pytest.raises(AssertionError, match="ConnectionRefusedError"):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionRefusedError()), 0.05, "the port",
                   ignore=(ConnectionRefusedError,))
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], 30, "a key")


def test_the_check_runs_once_more_after_the_deadline() -> None:
    """A waiter woken past its deadline (a busy machine) still sees a condition that holds."""
    calls = itertools.count()
    assert wait_until(lambda: next(calls) == 1, 0.01, "the second look", interval=0.05)


def test_until_awaits_coroutine_checks_and_fails_like_wait_until() -> None:
    """The asyncio twin: awaitable checks are awaited; the timeout names what and the value."""
    polls = itertools.count()

    async def later() -> int:
        await asyncio.sleep(0)
        return next(polls)

    async def go() -> None:
        assert await until(later, 30, "two polls", accept=lambda n: n >= 2, interval=0) == 2
        with pytest.raises(AssertionError, match=r"waiting for a flag; last seen: False"):
            await until(lambda: False, 0.05, "a flag")

    asyncio.run(go())
