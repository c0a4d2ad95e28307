"""Paged KV cache bookkeeping: a fixed pool of blocks and per-request block tables.

Pure Python (no torch): the storage itself is `model.KVPool`. A request holds
`ceil(tokens / block_size)` blocks; blocks come back on finish or abort. When
the pool runs dry the scheduler queues new requests and preempts the youngest
running one instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BlockAllocator", "blocks_for"]


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockAllocator:
    """A free list over block ids 0..num_blocks-1 (LIFO: recently freed blocks are warm)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        """Blocks available now."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (vLLM's `kv_cache_usage_perc`, 0..1)."""
        return self.used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks; `MemoryError` if fewer are free (callers check first)."""
        if count > len(self._free):
            msg = f"{count} KV blocks wanted, {len(self._free)} free"
            raise MemoryError(msg)
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def release(self, blocks: Iterable[int]) -> None:
        """Give blocks back."""
        self._free.extend(reversed(list(blocks)))
