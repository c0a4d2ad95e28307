"""The fleet board: what the proxy's processes (`ftctl proxy --procs N`) tell each other.

Each process keeps its own `Fleet` (its own scrapes of the same workers and of the
canary daemon, so the scraped loads and the daemon's weights agree within one
scrape interval) and posts on the board what only it knows:

- the outcome of each request on each worker (counts of successes and failures and
  when the last of each happened): every other process replays them into its own
  breaker (`SharedBalancer.replay`), so a breaker opened by failures in one process
  opens in all of them, and a success anywhere closes it;
- the KV blocks and prefill tokens its requests hold on each worker: admission
  adds the other processes' figures to its own, so a worker filled through one
  process is busy for all of them between two scrapes.

The board is one anonymous shared mapping made by the parent before it forks, a
cell of six int64 per (process, worker); each cell has one writer (its process),
so no lock: a reader sees each 8-byte value whole (aligned stores, x86-64 and
arm64) and at worst one sync late. Failures in one process are not reported to
the daemon again by the others (only `Fleet.charge` reports).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.proxy.balancer import Balancer, WorkerSlot

if TYPE_CHECKING:
    from dynamo_ftctl.inventory.proxy import CacheAware

__all__ = ["FleetBoard", "SharedBalancer"]

# Cell fields (int64 each): counts of successes and failures, monotonic ns of the last of
# each (CLOCK_MONOTONIC is one clock for every process of the machine), KV blocks and
# prefill tokens this process's requests hold on the worker now.
_SUCCESSES, _FAILURES, _LAST_SUCCESS, _LAST_FAILURE, _KV_BLOCKS, _PREFILL = range(6)
_FIELDS = 6


class FleetBoard:
    """Cells of (process, worker) in one shared mapping; made before the fork."""

    def __init__(self, procs: int, workers: Iterable[str], *,
                 shared: FleetBoard | None = None, index: int = 0) -> None:
        """A new board (`shared`: a view of that one's mapping instead, `as_process`)."""
        self.procs = procs
        self.workers = {name: i for i, name in enumerate(workers)}
        if shared is None:
            size = max(1, procs * len(self.workers) * _FIELDS * 8)
            self._map = mmap.mmap(-1, size)  # anonymous, MAP_SHARED: children see writes
            self.cells = memoryview(self._map).cast("q")
        else:
            self._map, self.cells = shared._map, shared.cells
        self.index = index  # this process's row (`as_process`)

    def as_process(self, index: int) -> FleetBoard:
        """The same board, seen from process `index` (its row is the one it writes)."""
        return FleetBoard(self.procs, self.workers, shared=self, index=index)

    def at(self, proc: int, worker: str) -> int:
        """Offset of the cell of `worker` in `proc`'s row."""
        return (proc * len(self.workers) + self.workers[worker]) * _FIELDS

    def clear_row(self, proc: int) -> None:
        """Forget what a dead process posted on its workers' load (its outcomes stay)."""
        for name in self.workers:
            at = self.at(proc, name)
            self.cells[at + _KV_BLOCKS] = 0
            self.cells[at + _PREFILL] = 0

    def post_load(self, slot: WorkerSlot) -> None:
        """Post this process's KV blocks and prefill tokens on `slot`'s worker."""
        at = self.at(self.index, slot.name)
        self.cells[at + _KV_BLOCKS] = slot.kv_blocks
        self.cells[at + _PREFILL] = slot.pending_prefill_tokens

    def others_load(self, name: str) -> tuple[int, int]:
        """(KV blocks, prefill tokens) the other processes' requests hold on `name`."""
        kv = prefill = 0
        for proc in range(self.procs):
            if proc != self.index:
                at = self.at(proc, name)
                kv += self.cells[at + _KV_BLOCKS]
                prefill += self.cells[at + _PREFILL]
        return kv, prefill


@dataclass
class _Seen:
    successes: int = 0
    failures: int = 0


class SharedBalancer(Balancer):
    """A `Balancer` whose outcomes are posted on the board and replayed from the others'."""

    def __init__(self, slots: Iterable[WorkerSlot], board: FleetBoard, *,
                 clock: Clock = SYSTEM_CLOCK, breaker_threshold: int = 3,
                 recovery_s: float = 60.0, cache_aware: CacheAware | None = None) -> None:
        super().__init__(slots, clock=clock, breaker_threshold=breaker_threshold,
                         recovery_s=recovery_s, cache_aware=cache_aware)
        self.board = board
        self._seen = {(p, n): _Seen() for p in range(board.procs) for n in self.slots}
        # The history, the row of the process this one replaces included, once; from
        # now on our own row is what we post, not news.
        self.replay()
        for name in self.slots:
            del self._seen[board.index, name]

    def record_success(self, slot: WorkerSlot) -> None:
        """`Balancer.record_success`, posted on this process's row for the others."""
        super().record_success(slot)
        at = self.board.at(self.board.index, slot.name)
        self.board.cells[at + _SUCCESSES] += 1
        self.board.cells[at + _LAST_SUCCESS] = time.monotonic_ns()

    def record_failure(self, slot: WorkerSlot) -> None:
        """`Balancer.record_failure`, posted on this process's row for the others."""
        super().record_failure(slot)
        at = self.board.at(self.board.index, slot.name)
        self.board.cells[at + _FAILURES] += 1
        self.board.cells[at + _LAST_FAILURE] = time.monotonic_ns()

    def replay(self) -> None:
        """Replay into our breakers the outcomes the other processes posted since last time.

        A process's batch is known by its counts and the time of its last success and
        last failure; the batches of all processes go in the order of those times (a
        restarted child replays the history this way too, and ends where the others
        are). At most `breaker_threshold` failures a batch (more change nothing).
        """
        cells = self.board.cells
        for name, slot in self.slots.items():
            batches: list[tuple[int, bool, int]] = []  # (when, a success?, how many)
            for proc in range(self.board.procs):
                seen = self._seen.get((proc, name))
                if seen is None:
                    continue  # our own row, after the start
                at = self.board.at(proc, name)
                successes, failures = cells[at + _SUCCESSES], cells[at + _FAILURES]
                if successes > seen.successes:
                    batches.append((cells[at + _LAST_SUCCESS], True, 1))
                if failures > seen.failures:
                    batches.append((cells[at + _LAST_FAILURE], False,
                                    min(failures - seen.failures, self._threshold)))
                seen.successes, seen.failures = successes, failures
            for _, success, count in sorted(batches):
                for _ in range(count):
                    if success:
                        Balancer.record_success(self, slot)
                    else:
                        Balancer.record_failure(self, slot)

    def post_loads(self) -> None:
        """Post this process's KV blocks and prefill tokens on every worker."""
        for slot in self.slots.values():
            self.board.post_load(slot)
