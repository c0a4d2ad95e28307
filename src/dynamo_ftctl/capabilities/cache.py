"""`CapabilityCache`: one `Capabilities` per worker, probed on demand, forgotten on failure."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from dynamo_ftctl.capabilities.probe import (
    DEFAULT_TIMEOUT_S,
    Capabilities,
    admin_token_of,
    probe_capabilities,
)
from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from dynamo_ftctl.http1.transport import AsyncTransport
    from dynamo_ftctl.inventory import Worker

__all__ = ["CapabilityCache"]


class CapabilityCache:
    """One `Capabilities` per worker name: probed on demand, at most one probe in flight each.

    Entries live until `invalidate` (a failed worker) or `note_start_time` sees a new
    process start time (a restarted one). An unreachable answer is kept only
    `retry_unreachable_s`, so a worker that comes back is found again. Every probe
    goes through `transport`.
    """

    def __init__(self, *, transport: AsyncTransport,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 clock: Clock = SYSTEM_CLOCK, retry_unreachable_s: float = 5.0,
                 admin_token: Callable[[Worker], str | None] | None = None) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.clock = clock
        self.retry_unreachable_s = retry_unreachable_s
        self._admin_token = admin_token or admin_token_of
        self._entries: dict[str, tuple[Capabilities, float]] = {}
        self._inflight: dict[str, asyncio.Task[Capabilities]] = {}
        # Bumped by invalidate: a probe begun before a restart must not store its answer.
        self._generation: dict[str, int] = {}
        self._start_times: dict[str, float] = {}

    def get(self, worker: str) -> Capabilities | None:
        """The cached answer for `worker` (a name), without probing."""
        entry = self._entries.get(worker)
        if entry is None:
            return None
        caps, stored_at = entry
        if not caps.reachable and self.clock.now() - stored_at >= self.retry_unreachable_s:
            return None
        return caps

    def snapshot(self) -> dict[str, Capabilities]:
        """Every fresh cached answer, by worker name."""
        return {name: caps for name in list(self._entries) if (caps := self.get(name))}

    async def probe(self, worker: Worker, *, refresh: bool = False) -> Capabilities:
        """The cached answer, or a probe (joined if one for this worker is in flight)."""
        if not refresh and (cached := self.get(worker.name)) is not None:
            return cached
        task = self._inflight.get(worker.name)
        if task is None:
            task = asyncio.ensure_future(self._run(worker, self._generation.get(worker.name, 0)))
            self._inflight[worker.name] = task
        # shield: one impatient caller's cancellation must not cancel the others' probe.
        return await asyncio.shield(task)

    async def probe_all(self, workers: Iterable[Worker], *,
                        refresh: bool = False) -> tuple[Capabilities, ...]:
        """Probe several workers at once (cached answers are reused unless `refresh`)."""
        return tuple(await asyncio.gather(*(self.probe(w, refresh=refresh) for w in workers)))

    async def _run(self, worker: Worker, generation: int) -> Capabilities:
        try:
            caps = await probe_capabilities(worker, transport=self.transport,
                                            timeout_s=self.timeout_s,
                                            admin_token=self._admin_token(worker) or "",
                                            clock=self.clock)
        finally:
            if self._inflight.get(worker.name) is asyncio.current_task():
                del self._inflight[worker.name]
        if self._generation.get(worker.name, 0) == generation:
            self._entries[worker.name] = (caps, self.clock.now())
            if caps.process_start_time is not None:
                self._start_times.setdefault(worker.name, caps.process_start_time)
        return caps

    def invalidate(self, worker: str) -> None:
        """Forget `worker` (a name): its next `probe` asks it again."""
        self._entries.pop(worker, None)
        self._start_times.pop(worker, None)
        self._generation[worker] = self._generation.get(worker, 0) + 1
        # The in-flight probe may predate the failure: later callers start a new one.
        self._inflight.pop(worker, None)

    def note_start_time(self, worker: str, value: float) -> bool:
        """Tell the cache `worker`'s `process_start_time_seconds`; True when it restarted.

        A value other than the one known (from a probe or an earlier note)
        invalidates the worker's entry.
        """
        known = self._start_times.get(worker)
        if known is None:
            entry = self._entries.get(worker)
            known = entry[0].process_start_time if entry else None
        if known is not None and known != value:
            self.invalidate(worker)
            self._start_times[worker] = value
            return True
        self._start_times[worker] = value
        return False

    async def aclose(self) -> None:
        """Cancel the probes in flight."""
        tasks = list(self._inflight.values())
        self._inflight.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
