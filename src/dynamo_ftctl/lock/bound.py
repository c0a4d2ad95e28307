"""The stop bound of an flock holder, and the settle wait it sets for the next one.

An flock belongs to an inode, not a name: once the lock file is deleted or replaced,
the next engine locks another inode and would run beside the old holder. Two sides of
one bound keep them apart:

- the holder watches its lock file and, once it is gone, stops its command: SIGTERM
  within `watch_interval_s` (inotify tells the `lock acquire -- CMD` watcher at once;
  the library's watch thread polls at the interval), SIGKILL `term_grace_s` after it;
- an acquirer that locks a file the token floor has not seen (new, or replaced: not
  the inode the last token was issued for) waits `stop_bound_s` before it issues its
  token and runs, so a holder of the old file has stopped first.

Every engine sharing a lock must agree on the two settings: they are pod-wide
variables (`$FTCTL_LOCK_WATCH_INTERVAL`, `$FTCTL_LOCK_TERM_GRACE`), read here once.
This module imports nothing but `errors`.
"""

from __future__ import annotations

import math
import os

from dynamo_ftctl.errors import InvalidInput

__all__ = [
    "SCHEDULING_MARGIN_S", "TERM_GRACE_ENV", "TERM_GRACE_S", "WATCH_INTERVAL_ENV",
    "WATCH_INTERVAL_S", "seconds_from_env", "stop_bound_s", "term_grace_from_env",
    "watch_interval_from_env",
]

# How often a holder checks its lock file by default (the poll; inotify is faster).
WATCH_INTERVAL_S = 0.5
WATCH_INTERVAL_ENV = "FTCTL_LOCK_WATCH_INTERVAL"
# How long a command gets to exit after SIGTERM when its lock file goes, before SIGKILL.
TERM_GRACE_S = 5.0
TERM_GRACE_ENV = "FTCTL_LOCK_TERM_GRACE"
# Time for the watcher to be scheduled and its signal delivered, on top of the interval
# and the grace (tests/integration/lock/test_no_overlap.py holds the defaults' 6.0 s).
SCHEDULING_MARGIN_S = 0.5


def stop_bound_s(watch_interval_s: float, term_grace_s: float) -> float:
    """Seconds from a lock file's deletion or replacement until its holder's command has
    stopped (SIGKILL sent at the latest): interval + grace + margin; 0 when the watch is
    off (`watch_interval_s` 0: no bound, no wait, as flock(1))."""
    if watch_interval_s <= 0:
        return 0.0
    return watch_interval_s + term_grace_s + SCHEDULING_MARGIN_S


def seconds_from_env(name: str, default: float) -> float:
    """`$name` as seconds >= 0, `default` when unset or empty; `InvalidInput` (one line
    naming the variable) when it is not."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        msg = f"${name}: not a number of seconds: {raw!r}"
        raise InvalidInput(msg) from None
    if not math.isfinite(value) or value < 0:
        msg = f"${name}: expected seconds >= 0, got {raw!r}"
        raise InvalidInput(msg)
    return value


def watch_interval_from_env() -> float:
    """`$FTCTL_LOCK_WATCH_INTERVAL`, else 0.5 s (0 turns the watch off)."""
    return seconds_from_env(WATCH_INTERVAL_ENV, WATCH_INTERVAL_S)


def term_grace_from_env() -> float:
    """`$FTCTL_LOCK_TERM_GRACE`, else 5 s."""
    return seconds_from_env(TERM_GRACE_ENV, TERM_GRACE_S)
