"""Time as an interface: a monotonic clock for real use and a fake one for tests.

Retry loops, health state machines and breakers take a `Clock` so that tests
drive time forward instead of sleeping (STYLE.md rule 5).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "FakeClock", "MonotonicClock"]


class Clock(Protocol):
    """Monotonic seconds plus the matching ways to wait."""

    def now(self) -> float:
        """Monotonic time in seconds."""
        ...

    def wall(self) -> float:
        """Wall-clock time in seconds since the epoch (for logs and reports)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for `seconds`."""
        ...

    async def asleep(self, seconds: float) -> None:
        """Suspend the calling task for `seconds`."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic`, `time.sleep`, `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        import asyncio  # ~20 ms to import: only the async callers pay it

        await asyncio.sleep(max(0.0, seconds))


SYSTEM_CLOCK: Clock = MonotonicClock()


class FakeClock:
    """A clock that only moves when told to: `advance`, or a call to `sleep`.

    `sleep` and `asleep` advance the clock instantly, so code under test that
    waits for 60 s of recovery time runs in microseconds.
    """

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def step_wall(self, seconds: float) -> None:
        """Step the wall clock by `seconds`, back when negative (what NTP or an operator
        does); the monotonic clock is not moved."""
        self._wall_offset += seconds

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` (never backwards)."""
        if seconds < 0:
            msg = "a monotonic clock cannot go backwards"
            raise ValueError(msg)
        self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(max(0.0, seconds))
        import asyncio

        await asyncio.sleep(0)
