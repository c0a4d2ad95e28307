"""Failover locks: at most one engine of a primary/shadow pair serves a GPU set.

`FlockLock` (one node, a file on a shared emptyDir) and `EtcdLock` (across
nodes) implement `FailoverLock`; `holder` holds a lock for a command's life,
`failover` wraps an engine as a shadow. This package imports neither the HTTP client nor
prometheus_client: they load only when an etcd lock or metrics are used (and
`EtcdLock`, with asyncio, on first use).
"""

from typing import TYPE_CHECKING, Any

from dynamo_ftctl.lock.flock import FlockLock, read_owner
from dynamo_ftctl.lock.protocol import FailoverLock, Lease, LeaseLost, LockStatus, OwnerInfo
from dynamo_ftctl.lock.settings import LockSettings, open_lock, resolve_lock_settings

if TYPE_CHECKING:
    from dynamo_ftctl.lock.etcd import EtcdLock

__all__ = [
    "EtcdLock",
    "FailoverLock",
    "FlockLock",
    "Lease",
    "LeaseLost",
    "LockSettings",
    "LockStatus",
    "OwnerInfo",
    "open_lock",
    "read_owner",
    "resolve_lock_settings",
]


def __getattr__(name: str) -> Any:
    """`EtcdLock` on first use: its module loads asyncio and ssl, which the flock path
    (`ftctl lock acquire` in an engine's entrypoint) must not pay for."""
    if name == "EtcdLock":
        from dynamo_ftctl.lock.etcd import EtcdLock

        return EtcdLock
    raise AttributeError(name)
