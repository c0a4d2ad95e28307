"""A request's KV blocks between a paged cache and the wire format, through the block copier.

`gather_payload` copies the request's blocks with `copy_blocks` straight into
the block region of the export buffer (`wire.encode_kv_into`: on one device,
one index op per cache tensor, no staging), and the wire format's per-block
checksums are computed over those bytes. `scatter_payload` copies the blocks
of an export that `wire.decode_kv` has verified (header CRC, every block's
checksum) into the cache's blocks with `copy_blocks` (host to device through
pinned staging when the cache is on a GPU).

A cache is a sequence of tensors in the wire's order inside one block: the
wire's `order` "layer,kv,token,head,dim" is served by per-(layer, K/V)
tensors `[k0, v0, k1, v1, ...]` each `[num_blocks, block_size, heads, dim]`
(the sim's pool), or by per-layer tensors holding K and V together, in any
layout whose block index sits on `block_dim` (vLLM `[num_blocks, 2, ...]`,
block_dim 0; flash `[2, num_blocks, ...]`, block_dim 1, is transposed into
the wire order by the copy itself).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv.copy import copy_blocks
from dynamo_ftctl.kv.wire import KvHeader, KvPayload, encode_kv_into

if TYPE_CHECKING:
    import torch

__all__ = ["gather_payload", "scatter_payload"]

_ALIGN = 16  # the copier views blocks as 16-byte elements where their sizes allow


def _block_views(
    region: memoryview, caches: Sequence[torch.Tensor], blocks: int, block_dim: int,
    layout_bytes: int,
) -> list[torch.Tensor]:
    """Per-cache-tensor views of `blocks` wire blocks in `region`, blocks on `block_dim`."""
    import torch

    first = caches[0]
    block_shape = tuple(first.movedim(block_dim, 0).shape[1:])
    per_block = len(caches) * math.prod(block_shape) * first.element_size()
    if per_block != layout_bytes:
        msg = (f"KV layout: {len(caches)} cache tensors of {block_shape} {first.dtype} make "
               f"{per_block}-byte blocks, the export's layout says {layout_bytes}")
        raise InvalidInput(msg)
    if blocks == 0:
        return [torch.empty((0, *block_shape), dtype=first.dtype).movedim(0, block_dim)
                for _ in caches]
    with warnings.catch_warnings():
        # An import's buffer is read-only; it is only ever read (the copy's source).
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(region, dtype=torch.uint8)
    if flat.data_ptr() % _ALIGN:
        flat = flat.clone()  # a foreign export whose blocks are not aligned: read a copy
    data = flat.view(first.dtype).view(blocks, len(caches), *block_shape)
    return [data[:, j].movedim(0, block_dim) for j in range(len(caches))]


def _as_ids(block_ids: Sequence[int]) -> Sequence[int] | torch.Tensor:
    """Block ids as an int64 tensor, which takes the copier's short host path (a block
    table is a list of ints); anything else as given, for the copier to name."""
    import torch

    if all(type(b) is int for b in block_ids):
        with contextlib.suppress(RuntimeError, OverflowError):  # past int64: out of range
            return torch.tensor(block_ids, dtype=torch.long)
    return block_ids


def _check_dtype(caches: Sequence[torch.Tensor], dtype: str) -> None:
    if not caches:
        msg = "a KV cache needs at least one tensor"
        raise InvalidInput(msg)
    names = {str(c.dtype).removeprefix("torch.") for c in caches}
    if names != {dtype}:
        msg = f"KV layout: the cache holds {', '.join(sorted(names))}, the export {dtype}"
        raise InvalidInput(msg)


def gather_payload(
    header: KvHeader, caches: Sequence[torch.Tensor], block_ids: Sequence[int],
    *, block_dim: int = 0,
) -> memoryview:
    """The export of `header` with blocks `block_ids` of `caches` copied into it.

    `block_ids` are the request's first `header.num_blocks` blocks, in token order.
    """
    import torch

    _check_dtype(caches, header.layout.dtype)
    if len(block_ids) != header.num_blocks:
        msg = (f"{len(block_ids)} block ids for the {header.num_blocks} blocks of "
               f"{header.num_tokens} tokens")
        raise InvalidInput(msg)
    dim = block_dim % caches[0].dim()

    def fill(region: memoryview) -> None:
        views = _block_views(region, caches, header.num_blocks, dim, header.layout.block_bytes)
        copy_blocks(caches, views, _as_ids(block_ids), torch.arange(header.num_blocks),
                    block_dim=dim).wait()

    return encode_kv_into(header, fill)


def scatter_payload(
    payload: KvPayload, caches: Sequence[torch.Tensor], block_ids: Sequence[int],
    *, block_dim: int = 0,
) -> None:
    """Copy the verified blocks of `payload` into blocks `block_ids` of `caches`."""
    import torch

    header = payload.header
    _check_dtype(caches, header.layout.dtype)
    if len(block_ids) != header.num_blocks:
        msg = f"{len(block_ids)} destination blocks for {header.num_blocks} exported blocks"
        raise InvalidInput(msg)
    dim = block_dim % caches[0].dim()
    views = _block_views(payload.data, caches, header.num_blocks, dim, header.layout.block_bytes)
    copy_blocks(views, caches, torch.arange(header.num_blocks), _as_ids(block_ids),
                block_dim=dim).wait()
