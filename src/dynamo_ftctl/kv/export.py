"""Export and import of KV blocks with per-block CRC-32 checksums.

`export_blocks` copies blocks out of a cache into block-first host tensors and
checksums them; `import_blocks` verifies every checksum before a single byte
is written, then copies them in (`copy.copy_blocks`). The wire format is
`kv/wire.py`'s.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv.copy import DEFAULT_CHUNK_BYTES, copy_blocks
from dynamo_ftctl.kv.streams import CopyHandle, StreamOps

if TYPE_CHECKING:
    import torch

__all__ = ["ExportedBlocks", "KVChecksumError", "block_checksums", "export_blocks",
           "import_blocks"]


class KVChecksumError(InvalidInput):
    """An imported block's bytes do not match the checksum computed at export."""


@dataclass(frozen=True)
class ExportedBlocks:
    """Blocks taken out of a cache: host tensors per layer plus a CRC-32 per block.

    `data[layer]` is contiguous `[n_blocks, *block_shape]` (blocks first, whatever
    the cache's layout), so block i of a layer is one contiguous byte range.
    The checksum of block i chains CRC-32 over its bytes in every layer, in order.
    """

    data: tuple[torch.Tensor, ...]
    checksums: tuple[int, ...]
    block_dim: int = 0

    @property
    def blocks(self) -> int:
        """How many blocks were exported."""
        return len(self.checksums)

    @property
    def nbytes(self) -> int:
        """Payload bytes over all layers."""
        return sum(t.numel() * t.element_size() for t in self.data)


def block_checksums(data: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """CRC-32 per block of block-first host tensors (chained across layers)."""
    if not data:
        return ()
    n = data[0].shape[0]
    byte_rows = []
    for layer in data:
        if layer.device.type != "cpu" or not layer.is_contiguous() or layer.shape[0] != n:
            msg = "checksums need contiguous host tensors with the same number of blocks"
            raise InvalidInput(msg)
        byte_rows.append(_byte_view(layer))
    sums = []
    for i in range(n):
        crc = 0
        for rows in byte_rows:
            crc = zlib.crc32(rows[i], crc)
        sums.append(crc)
    return tuple(sums)


def _byte_view(layer: torch.Tensor) -> Any:
    import torch

    # A zero-copy numpy view of the raw bytes (works for bf16/fp8 too).
    return layer.reshape(layer.shape[0], -1).view(torch.uint8).numpy()


def export_blocks(
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    *,
    block_dim: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ops: StreamOps | None = None,
) -> ExportedBlocks:
    """Copy `block_ids` out of `caches` into host memory and checksum every block
    (`ops`: the copier's stream seam, its default for the caches' device when None)."""
    import torch

    if not caches:
        msg = "a cache needs at least one layer"
        raise InvalidInput(msg)
    dim = block_dim % caches[0].dim()
    count = len(block_ids)
    data = tuple(
        torch.empty((count, *c.movedim(dim, 0).shape[1:]), dtype=c.dtype) for c in caches
    )
    views = [t.movedim(0, dim) for t in data]
    copy_blocks(
        caches, views, block_ids, torch.arange(count), block_dim=dim, chunk_bytes=chunk_bytes,
        ops=ops,
    ).wait()
    return ExportedBlocks(data=data, checksums=block_checksums(data), block_dim=dim)


def import_blocks(
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    exported: ExportedBlocks,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> CopyHandle:
    """Verify every block's checksum, then copy the blocks into `block_ids` of `caches`.

    Nothing is written when a checksum fails (`KVChecksumError`, exit 2).
    """
    if len(block_ids) != exported.blocks:
        msg = f"{len(block_ids)} destination blocks for {exported.blocks} exported blocks"
        raise InvalidInput(msg)
    actual = block_checksums(exported.data)
    for index, (want, got) in enumerate(zip(exported.checksums, actual, strict=True)):
        if want != got:
            msg = (f"exported block {index}: checksum mismatch "
                   f"(expected {want:#010x}, got {got:#010x})")
            raise KVChecksumError(msg)
    import torch

    views = [t.movedim(0, exported.block_dim) for t in exported.data]
    return copy_blocks(
        views, caches, torch.arange(exported.blocks), block_ids, block_dim=exported.block_dim,
        chunk_bytes=chunk_bytes,
    )
