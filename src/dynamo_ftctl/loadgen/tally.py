"""Counts shared by the processes of one run (`ftctl load --procs N`), for its abort rule.

`--abort-error-rate` is a rule about the run, not about one process: each forked
process adds what it finished and failed to its own slots of one shared anonymous
mapping (made before the fork, one writer per slot, so no lock), every process
reads the sums, and the first to see the run's error rate pass the limit raises
a flag the others see within `POLL_S` (or at their next finished request).
"""

from __future__ import annotations

import mmap
import struct

__all__ = ["POLL_S", "SharedTally"]

POLL_S = 0.05  # how often a process looks for another's abort while it has nothing to record
_SLOT = struct.Struct("=qq")  # finished, failed
_FLAG = struct.Struct("=q")


class SharedTally:
    """Finished and failed requests of each of `procs` processes, and the abort flag."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self._map = mmap.mmap(-1, _FLAG.size + procs * _SLOT.size)  # shared across fork
        self.index = 0  # this process's slot (set in the child after the fork)

    def record(self, finished: int, failed: int) -> tuple[int, int]:
        """Store this process's running counts; the run's (finished, failed) so far."""
        _SLOT.pack_into(self._map, _FLAG.size + self.index * _SLOT.size, finished, failed)
        return self.totals()

    def totals(self) -> tuple[int, int]:
        finished = failed = 0
        for j in range(self.procs):
            f, e = _SLOT.unpack_from(self._map, _FLAG.size + j * _SLOT.size)
            finished += f
            failed += e
        return finished, failed

    def abort(self) -> None:
        """Tell every process of the run to stop (1 + the index of the one that decided)."""
        if not self.aborted_by():
            _FLAG.pack_into(self._map, 0, self.index + 1)

    def aborted_by(self) -> int | None:
        """The index of the process that stopped the run, or None while it goes on."""
        flag = _FLAG.unpack_from(self._map, 0)[0]
        return flag - 1 if flag else None
