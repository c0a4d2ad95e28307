"""How tests wait: poll a condition until it holds, or fail at a deadline naming what was
awaited and the last value seen.

The one way a test waits for something another thread, task or process does (a port that
answers, a line in a log, a gauge, a process state). Never a bare sleep to let something
happen, never a hand-rolled `deadline = time.monotonic() + ...` loop. The timeout bounds a
wait that should end long before it; it is never what the test measures (time that a test
measures goes through the `Clock` seam, or into benchmarks/).

- `wait_until(check, timeout, what)`: threads and processes; sleeps between polls.
- `await until(check, timeout, what)`: asyncio tests; `check` may be a coroutine function.

`check` returns the value of interest; the wait ends when `accept(value)` holds (by
default the value's truth) and returns that value. Exceptions of the types in `ignore`
count as "not yet" (a server not yet listening) and show as the last value seen. The
check runs once more after the deadline, so a scheduler that wakes the waiter late (a busy
machine) fails a wait only when the condition really does not hold.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["until", "wait_until"]

T = TypeVar("T")

_NOTHING = object()


def _failure(what: str, timeout: float, last: object) -> AssertionError:
    seen = "nothing (the check never returned)" if last is _NOTHING else repr(last)
    if len(seen) > 2000:  # a page of HTML or a whole log: its end says most
        seen = "..." + seen[-2000:]
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {seen}")


def wait_until(check: Callable[[], T], timeout: float, what: str, *,
               accept: Callable[[T], object] = bool,
               ignore: tuple[type[BaseException], ...] = (),
               interval: float = 0.01) -> T:
    """Call `check` every `interval` s until `accept` takes its value; return that value.

    AssertionError naming `what` and the last value (or ignored exception) after `timeout` s."""
    end = time.monotonic() + timeout
    last: object = _NOTHING
    while True:
        try:
            value = check()
        except ignore as exc:
            last = exc
        else:
            if accept(value):
                return value
            last = value
        if time.monotonic() >= end:
            raise _failure(what, timeout, last)
        time.sleep(interval)  # polling a condition, bounded by `timeout`


async def until(check: Callable[[], T | Awaitable[T]], timeout: float = 5.0,
                what: str = "the condition", *,
                accept: Callable[[Any], object] = bool,
                ignore: tuple[type[BaseException], ...] = (),
                interval: float = 0.005) -> Any:
    """The asyncio twin of `wait_until`: polls on the running loop's clock, awaiting
    `check`'s result when it is awaitable."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    last: object = _NOTHING
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except ignore as exc:
            last = exc
        else:
            if accept(value):
                return value
            last = value
        if loop.time() >= end:
            raise _failure(what, timeout, last)
        await asyncio.sleep(interval)  # polling a condition, bounded by `timeout`
