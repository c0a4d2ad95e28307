"""The worker's half of the connector: blocks between vLLM's paged cache and the store.

`BlockMover` holds one worker's per-layer cache tensors (vLLM's
`register_kv_caches`), and carries out a `StepPlan`'s moves through the KV block
copier (`kv.copy.copy_blocks`, `kv.export.export_blocks`): on a GPU through
pinned host buffers and a side CUDA stream, on CPU with plain copies, the same
code. A saved block's file holds its bytes layer after layer, checksummed with
CRC-32 over all of them (the copier's export checksum).

- **Load.** A request's blocks are read in order into host buffers, each checked
  (the store's header, this cache's geometry, the CRC); the first that fails
  ends the load there: that block and those after it are reported as failed
  (`failed_blocks`: vLLM recomputes from there with `kv_load_failure_policy:
  recompute`) and a damaged file is removed. The good ones are copied into the
  cache before the forward pass reads them.
- **Save.** Blocks whose files exist are skipped; the rest are exported and
  written. A store that cannot be written (full disk, gone) loses the saves,
  never the step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import InvalidInput, WriteFailed
from dynamo_ftctl.kv.blockstore import BlockStore
from dynamo_ftctl.kv.copy import copy_blocks
from dynamo_ftctl.kv.export import export_blocks
from dynamo_ftctl.vllm_connector._plan import BlockMove, StepPlan

if TYPE_CHECKING:
    import torch

    from dynamo_ftctl.kv.streams import StreamOps

__all__ = ["BlockMover", "MoveStats", "cache_geometry"]

log = logging.getLogger("dynamo_ftctl.vllm_connector")


@dataclass
class MoveStats:
    """Counts since the mover started (for logs and the benchmark)."""

    loaded_blocks: int = 0
    failed_blocks: int = 0
    saved_blocks: int = 0
    skipped_saves: int = 0  # already in the store
    saved_bytes: int = 0
    save_errors: int = 0


def cache_geometry(caches: Sequence[torch.Tensor], block_dim: int) -> bytes:
    """What a block file must match to be loaded into `caches`: layer count, dtype, and
    each layer's shape without its block dimension."""
    shapes = ";".join(
        "x".join(str(n) for i, n in enumerate(c.shape) if i != block_dim) for c in caches)
    return f"{len(caches)}|{caches[0].dtype}|{shapes}".encode()


def _unique_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The cache tensors in registration order, once each (layers may share one)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    layers = []
    for tensor in kv_caches.values():
        mark = (tensor.data_ptr(), tuple(tensor.shape))
        if mark not in seen:
            seen.add(mark)
            layers.append(tensor)
    return layers


def _block_dim(caches: Sequence[torch.Tensor], num_blocks: int) -> int:
    """The dimension that indexes blocks: the first of size `num_blocks` (vLLM CPU and
    flash-style `[num_blocks, ...]`: 0; `[2, num_blocks, ...]`: 1)."""
    for dim, size in enumerate(caches[0].shape):
        if size == num_blocks:
            return dim
    msg = f"no dimension of size {num_blocks} (the block count) in {tuple(caches[0].shape)}"
    raise InvalidInput(msg)


class BlockMover:
    """One worker's loads and saves. `ops` is the copier's stream seam (tests pass fakes);
    `suffix` names this worker's shard of every block."""

    def __init__(self, store: BlockStore, *, suffix: str = "",
                 ops: StreamOps | None = None) -> None:
        self.store = store
        self.suffix = suffix
        self.ops = ops
        self.caches: list[torch.Tensor] = []
        self.block_dim = 0
        self.geometry = b""
        self.stats = MoveStats()
        self._failed: set[int] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Keep the worker's cache tensors; find their block dimension."""
        self.caches = _unique_layers(kv_caches)
        if not self.caches:
            msg = "no KV cache tensors to register"
            raise InvalidInput(msg)
        self.block_dim = _block_dim(self.caches, num_blocks)
        self.geometry = cache_geometry(self.caches, self.block_dim)

    def run(self, plan: StepPlan) -> None:
        """A step's loads (before the forward pass reads the cache)."""
        for request_id, moves in plan.loads.items():
            self.load(request_id, moves)

    def failed_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM's
        `get_block_ids_with_load_errors`), then forgets them."""
        failed, self._failed = self._failed, set()
        return failed

    def _host_blocks(self, count: int) -> list[torch.Tensor]:
        """Block-first host buffers for `count` blocks of every layer (pinned when the
        cache is on a device, so the copy to it is a DMA)."""
        import torch

        pinned = self.caches[0].device.type != "cpu"
        return [torch.empty((count, *c.movedim(self.block_dim, 0).shape[1:]), dtype=c.dtype,
                            pin_memory=pinned) for c in self.caches]

    def load(self, request_id: str, moves: Sequence[BlockMove]) -> int:
        """Load `moves` (one request's, in block order) into the cache; returns the blocks
        loaded. The first block that fails ends the load (it and the rest are failed)."""
        import torch

        if not moves:
            return 0
        data = self._host_blocks(len(moves))
        rows = [t.reshape(len(moves), -1).view(torch.uint8).numpy() for t in data]
        good = 0
        for index, move in enumerate(moves):
            if not self.store.read_into(move.key, self.geometry, [r[index] for r in rows],
                                        suffix=self.suffix):
                self.store.discard(move.key, self.suffix)
                break
            good += 1
        failed = [m.block_id for m in moves[good:]]
        if good:
            views = [t[:good].movedim(0, self.block_dim) for t in data]
            copy_blocks(views, self.caches, torch.arange(good),
                        [m.block_id for m in moves[:good]], block_dim=self.block_dim,
                        ops=self.ops).wait()
        self._failed.update(failed)
        self.stats.loaded_blocks += good
        self.stats.failed_blocks += len(failed)
        if failed:
            log.warning("ftctl KV connector: request %s: %d of %d blocks loaded; block %d "
                        "failed its checks (a miss: the engine recomputes from there)",
                        request_id, good, len(moves), good)
        return good

    def save(self, moves: Sequence[BlockMove]) -> int:
        """Write the blocks of `moves` the store lacks; returns the bytes written."""
        todo = [m for m in moves if not self.store.has(m.key, self.suffix)]
        self.stats.skipped_saves += len(moves) - len(todo)
        if not todo:
            return 0
        exported = export_blocks(self.caches, [m.block_id for m in todo],
                                 block_dim=self.block_dim, ops=self.ops)
        rows = [_byte_rows(t) for t in exported.data]
        written = 0
        for index, move in enumerate(todo):
            try:
                written += self.store.write(move.key, self.geometry, [r[index] for r in rows],
                                            crc=exported.checksums[index], suffix=self.suffix)
            except WriteFailed as exc:
                self.stats.save_errors += 1
                if self.stats.save_errors == 1 or self.stats.save_errors % 1000 == 0:
                    log.warning("ftctl KV connector: cannot write to the store %s (%s); "
                                "%d saves lost so far", self.store.root, exc,
                                self.stats.save_errors)
                return written
            self.stats.saved_blocks += 1
        self.stats.saved_bytes += written
        return written


def _byte_rows(tensor: torch.Tensor) -> Any:
    import torch

    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8).numpy()
