"""Where a lock's settings come from: flags, then environment, then the inventory.

`--path` / `$FAILOVER_LOCK_PATH` / `lock.path`; `--endpoint`, `--key`, `--ttl`
/ `lock.etcd`; `--engine-id` / `$ENGINE_ID` (0 may be primary, >= 1 shadow);
`--watch-interval` / `$FTCTL_LOCK_WATCH_INTERVAL` (flock only, default 0.5 s);
`$FTCTL_LOCK_TERM_GRACE` (flock, default 5 s: SIGTERM to SIGKILL of a holder whose
lock file went; with the interval, the stop bound of `bound.py`).
The inventory (PyYAML and msgspec with it) is read only when a flag or variable
is missing, so `ftctl lock status --path P` stays fast in probes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.lock.bound import TERM_GRACE_S, WATCH_INTERVAL_S, term_grace_from_env

if TYPE_CHECKING:
    from dynamo_ftctl.inventory.lock import LockConfig
    from dynamo_ftctl.lock.protocol import FailoverLock

__all__ = ["LockSettings", "engine_id_from_env", "open_lock", "resolve_lock_settings"]

PATH_ENV = "FAILOVER_LOCK_PATH"
ENGINE_ID_ENV = "ENGINE_ID"
WATCH_INTERVAL_ENV = "FTCTL_LOCK_WATCH_INTERVAL"
# The same defaults as inventory.lock.EtcdConfig, without reading the inventory.
DEFAULT_ENDPOINTS = ("http://127.0.0.1:2379",)
DEFAULT_KEY = "/ftctl/locks/failover"
DEFAULT_TTL_S = 5.0
DEFAULT_WATCH_INTERVAL_S = WATCH_INTERVAL_S

Backend = Literal["flock", "etcd"]


@dataclass(frozen=True)
class LockSettings:
    """Everything needed to open one failover lock."""

    backend: Backend
    engine_id: int
    path: Path | None = None
    endpoints: tuple[str, ...] = DEFAULT_ENDPOINTS
    key: str = DEFAULT_KEY
    ttl_s: float = DEFAULT_TTL_S
    # flock: how often the holder checks its lock file was not deleted or replaced (0: never).
    watch_interval_s: float = DEFAULT_WATCH_INTERVAL_S
    # flock: SIGTERM to SIGKILL of a command whose lock file was deleted or replaced.
    term_grace_s: float = TERM_GRACE_S


def engine_id_from_env(explicit: int | None) -> int:
    """`--engine-id`, else `$ENGINE_ID`, else 0."""
    if explicit is not None:
        value = explicit
    else:
        raw = os.environ.get(ENGINE_ID_ENV, "0").strip() or "0"
        try:
            value = int(raw)
        except ValueError:
            msg = f"${ENGINE_ID_ENV}: not an integer: {raw!r}"
            raise InvalidInput(msg) from None
    if value < 0:
        msg = f"engine id must be >= 0 (0 may be primary, >= 1 shadow), got {value}"
        raise InvalidInput(msg)
    return value


def _check_watch_interval(value: float | None, backend: str) -> float:
    """`--watch-interval`, else `$FTCTL_LOCK_WATCH_INTERVAL` (flock only), else 0.5 s."""
    source = "--watch-interval"
    if value is None:
        raw = os.environ.get(WATCH_INTERVAL_ENV, "").strip()
        if not raw or backend != "flock":  # a pod-wide variable must not break etcd
            return DEFAULT_WATCH_INTERVAL_S
        source = f"${WATCH_INTERVAL_ENV}"
        try:
            value = float(raw)
        except ValueError:
            msg = f"{source}: not a number of seconds: {raw!r}"
            raise InvalidInput(msg) from None
    elif backend != "flock":
        msg = ("--watch-interval works with the flock backend only (an etcd holder learns "
               "of a lost key with its keep-alive)")
        raise InvalidInput(msg)
    if not math.isfinite(value) or value < 0:
        msg = f"{source}: expected seconds >= 0 (0 turns the watch off), got {value}"
        raise InvalidInput(msg)
    return value


def resolve_lock_settings(
    *, backend: str | None, engine_id: int | None, path: Path | None = None,
    endpoints: Sequence[str] = (), key: str | None = None, ttl_s: float | None = None,
    watch_interval_s: float | None = None,
    inventory: Callable[[], LockConfig | None] = lambda: None,
) -> LockSettings:
    """Merge flags, environment and (only if needed) the inventory's `lock:` section."""
    chosen = backend or "flock"
    if chosen not in ("flock", "etcd"):
        msg = f"--backend: expected 'flock' or 'etcd', got {chosen!r}"
        raise InvalidInput(msg)
    eid = engine_id_from_env(engine_id)
    watch = _check_watch_interval(watch_interval_s, chosen)
    if chosen == "flock":
        if path is None and os.environ.get(PATH_ENV):
            path = Path(os.environ[PATH_ENV])
        if path is None:
            config = inventory()
            path = config.path if config is not None else None
        if path is None:
            msg = (f"no lock file: pass --path, set ${PATH_ENV}, "
                   "or set lock.path in the inventory")
            raise InvalidInput(msg)
        return LockSettings(backend="flock", engine_id=eid, path=path, watch_interval_s=watch,
                            term_grace_s=term_grace_from_env())
    if not endpoints or key is None or ttl_s is None:
        config = inventory()
        if config is not None:
            endpoints = endpoints or tuple(str(e) for e in config.etcd.endpoints)
            key = key or config.etcd.key
            ttl_s = ttl_s if ttl_s is not None else config.etcd.ttl_s
    return LockSettings(
        backend="etcd", engine_id=eid, endpoints=tuple(endpoints) or DEFAULT_ENDPOINTS,
        key=key or DEFAULT_KEY, ttl_s=DEFAULT_TTL_S if ttl_s is None else ttl_s,
    )


def open_lock(settings: LockSettings, *, metrics: bool = False) -> FailoverLock:
    """Build the lock the settings describe (etcd loads http1 here; flock, nothing)."""
    if settings.backend == "flock":
        from dynamo_ftctl.lock.flock import FlockLock

        assert settings.path is not None
        return FlockLock(settings.path, settings.engine_id, metrics=metrics,
                         watch_interval_s=settings.watch_interval_s,
                         term_grace_s=settings.term_grace_s)
    from dynamo_ftctl.lock.etcd import EtcdLock

    return EtcdLock(settings.endpoints, settings.key, settings.engine_id,
                    ttl_s=settings.ttl_s, metrics=metrics)
