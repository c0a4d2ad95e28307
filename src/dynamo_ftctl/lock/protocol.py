"""What every failover lock backend promises, and the results it returns.

A `FailoverLock` is held by at most one engine at a time. Each acquisition
carries a fencing token that is strictly greater than every token issued
before it, so storage that sees a token can refuse writes from an older holder.
A holder that loses the lock (an etcd lease expired, an flock file deleted or
replaced) is told through `set_on_lost` and `ensure_held`; until it stops, the
token is what keeps its writes out.
This module imports nothing heavy; `record_*` load prometheus_client only when
a caller asked for metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dynamo_ftctl.errors import LeaseLost

__all__ = [
    "FailoverLock",
    "Lease",
    "LeaseLost",
    "LockStatus",
    "OwnerInfo",
    "record_acquired",
    "record_released",
]


@dataclass(frozen=True)
class OwnerInfo:
    """Who holds (or last held) a lock; `live` is False for data left by a dead holder."""

    lock: str
    backend: str
    live: bool
    engine_id: int | None = None
    pid: int | None = None
    host: str | None = None
    acquired_at: float | None = None
    token: int | None = None


@dataclass(frozen=True)
class Lease:
    """One successful acquisition: the fencing token and how long it took."""

    lock: str
    backend: str
    engine_id: int
    token: int
    acquired_at: float
    waited_s: float
    fd: int | None = None

    def plain_text(self) -> str:
        """Key and value per line, as the rich table lays them out (pipes and scripts get
        this without rich's import, after `acquire --fd` holds the lock)."""
        rows = [(name, getattr(self, name)) for name in (
            "lock", "backend", "engine_id", "token", "acquired_at", "waited_s", "fd")]
        width = max(len(name) for name, _ in rows)
        return "".join(f"{name.ljust(width)}  {_plain(value)}\n" for name, value in rows)


def _plain(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class LockStatus:
    """The answer of `ftctl lock owner|status`: held or free, and the owner data."""

    lock: str
    backend: str
    held: bool
    owner: OwnerInfo | None


@runtime_checkable
class FailoverLock(Protocol):
    """A lock that at most one engine holds; see `FlockLock` and `EtcdLock`."""

    @property
    def name(self) -> str:
        """The lock's name in messages and metrics (a path or an etcd key)."""
        ...

    @property
    def is_held(self) -> bool:
        """True while this object holds the lock (False once released or lost)."""
        ...

    def acquire(self, timeout: float | None = None) -> Lease:
        """Block until the lock is held; `LockTimeout` after `timeout` seconds."""
        ...

    async def aacquire(self, timeout: float | None = None) -> Lease:
        """`acquire` for asyncio: cancelling the task gives the lock up cleanly."""
        ...

    def release(self) -> None:
        """Give the lock up (a no-op when not held)."""
        ...

    def ensure_held(self) -> Lease:
        """The lease, or `LeaseLost` when it was lost (call before every fenced write)."""
        ...

    def set_on_lost(self, callback: Callable[[LeaseLost], None] | None) -> None:
        """Replace the callback told (from a helper thread) that the lock was lost."""
        ...

    def owner(self) -> OwnerInfo | None:
        """The current or last holder, or None when the lock has never been held."""
        ...

    def status(self) -> LockStatus:
        """Held or free, with the owner data."""
        ...


def record_acquired(lease: Lease) -> None:
    """Export the acquisition: `ftctl_lock_holder` = 1 and the wait in the histogram."""
    from dynamo_ftctl.metrics import LOCK_ACQUIRE_SECONDS, LOCK_HOLDER

    LOCK_ACQUIRE_SECONDS.observe(lease.waited_s)
    LOCK_HOLDER.labels(lock=lease.lock, engine_id=str(lease.engine_id)).set(1)


def record_released(lock: str, engine_id: int) -> None:
    """Export the release: `ftctl_lock_holder` = 0."""
    from dynamo_ftctl.metrics import LOCK_HOLDER

    LOCK_HOLDER.labels(lock=lock, engine_id=str(engine_id)).set(0)
