"""Which of several canary daemons acts: the holder of one failover lock.

Two or more daemons may watch one fleet, so that losing one loses no judgment:
each probes every worker and serves `/workers`, but only the daemon that holds
`canary.acting_lock` (an flock on a volume the daemons share) runs the
inventory's actions (drain, restart). The others wait on the lock; the kernel
hands it over the moment the actor dies.

No action runs twice for one episode. The actor writes, beside the lock
(`LOCK.acted`, replaced whole by `safefiles.write_atomic`), the state each
worker was last acted on: a transition runs its actions only when it enters a
state other than the one recorded. So a new actor that finds a worker already
drained by the old one leaves it alone, and one that finds a worker entered a
state with actions while nobody acted (the actor died in between) catches up
once, on taking the lock (`catch_up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import InvalidInput, LeaseLost
from dynamo_ftctl.jsoncodec import loads

if TYPE_CHECKING:
    from dynamo_ftctl.lock.flock import FlockLock

__all__ = ["ACTED_SUFFIX", "ActingGate", "acted_path"]

_log = logging.getLogger("ftctl.canary")
ACTED_SUFFIX = ".acted"
# The record of acted states is a few bytes a worker; anything far past that is not ours.
_ACTED_MAX = 16 * 1024 * 1024
# After a lost lock, how long before trying again (the lock file was deleted or replaced).
_RETRY_S = 0.5


def acted_path(lock_path: Path) -> Path:
    """Where the actor records the state each worker was last acted on."""
    return lock_path.with_name(lock_path.name + ACTED_SUFFIX)


class ActingGate:
    """The acting lock of one daemon: `acting` while it holds it; `acted`/`record` for the
    shared record of acted states. Without a lock path every daemon acts (one daemon)."""

    def __init__(self, lock_path: Path | None, *, lock: FlockLock | None = None) -> None:
        self.path = lock_path
        self.acting = lock_path is None
        self.since: float | None = None
        self._lock = lock
        self._acted: dict[str, str] = {}
        self._lost = asyncio.Event()

    def acted(self, worker: str) -> str | None:
        """The state `worker` was last acted on (by any daemon), or None."""
        return self._acted.get(worker)

    def record(self, worker: str, state: str) -> None:
        """Note that `worker`'s entry into `state` was acted on (written through at once)."""
        self._acted[worker] = state
        if self.path is None:
            return
        from dynamo_ftctl.safefiles import write_atomic

        try:
            write_atomic(acted_path(self.path), json.dumps(self._acted, sort_keys=True) + "\n")
        except OSError as exc:  # the lock's volume went read-only or full: say so, go on
            _log.warning("%s: cannot record acted states: %s", acted_path(self.path),
                         exc.strerror or exc)

    def _load(self) -> None:
        assert self.path is not None
        from dynamo_ftctl.safefiles import read_regular

        path = acted_path(self.path)
        try:
            doc = loads(read_regular(path, _ACTED_MAX))
        except FileNotFoundError:
            self._acted = {}
            return
        except (InvalidInput, ValueError):  # over the bound, or not JSON
            doc = None
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            _log.warning("%s: not a record of acted states: ignored (every worker's current "
                         "state with actions is acted on once)", path)
            doc = {}
        self._acted = {str(k): v for k, v in doc.items()}

    async def hold(self, stop: asyncio.Event, on_acting: Callable[[], None]) -> None:
        """Until `stop`: wait for the lock, act while held (`on_acting` once on each grant,
        after the record is read), wait again when it is lost."""
        if self.path is None:
            await stop.wait()
            return
        lock = self._lock or self._open()
        while not stop.is_set():
            acquiring = asyncio.ensure_future(lock.aacquire())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not acquiring.done():
                acquiring.cancel()
                with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                    await acquiring
                stopping.cancel()
                return
            stopping.cancel()
            lease = acquiring.result()
            self._lost.clear()
            self._load()
            self.acting, self.since = True, lease.acquired_at
            _log.warning("acting: this daemon holds %s (token %d) and runs the actions",
                         self.path, lease.token)
            on_acting()
            lost = asyncio.ensure_future(self._lost.wait())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
            for task in (lost, stopping):
                task.cancel()
            self.acting, self.since = False, None
            with contextlib.suppress(LeaseLost, OSError):
                lock.release()
            if not stop.is_set():
                _log.warning("acting: %s was deleted or replaced: no longer acting; waiting "
                             "for the lock again", self.path)
                await asyncio.sleep(_RETRY_S)

    def _open(self) -> FlockLock:
        from dynamo_ftctl.lock.flock import FlockLock

        assert self.path is not None
        loop = asyncio.get_running_loop()
        if not self.path.parent.is_dir():
            msg = f"canary.acting_lock: {self.path.parent} is not a directory"
            raise InvalidInput(msg)
        def lost(_exc: LeaseLost) -> None:  # from the lock's watch thread
            loop.call_soon_threadsafe(self._lost.set)

        # In-process: acting stops the moment the watch sees the file go (no grace), so a
        # new lock file is held interval + 0.5 s before this daemon acts (lock/bound.py).
        return FlockLock(self.path, term_grace_s=0.0, on_lost=lost)
