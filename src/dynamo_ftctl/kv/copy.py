"""Copy paged KV-cache blocks between caches on torch streams, and export/import them.

A cache is a sequence of per-layer tensors whose dimension `block_dim` indexes
blocks (vLLM: `[num_blocks, 2, block_size, kv_heads, head_dim]`, block_dim 0).
`copy_blocks` moves the blocks `src_ids` of one cache to the blocks `dst_ids`
of another, in pieces of (layer, chunk of blocks):

1. gather the chunk into a contiguous staging buffer beside the source
   (pinned host memory when the source is on the host and the copy crosses
   to a device);
2. copy the staging buffer to a staging buffer beside the destination with a
   `non_blocking` copy on a dedicated copy stream (skipped when source and
   destination share a device);
3. scatter it into the destination blocks.

Host to host, the native row-copy kernel (`kv/native.py`, C built at install)
copies every layer in one pass for any ids, all layers in one call (a common
copy, host caches shaped alike with int64 tensor ids, gets there with a
handful of torch calls: `host_copy`): a `memcpy`-sized copy per block,
large copies stored past the cache (their source blocks read in ascending
order) and shared among torch's intra-op threads. Without it (no compiler at
install, `FTCTL_KV_NATIVE=0`, `native=False`), and on devices, torch's kernels
do the work: when source and destination share a device and either id list is
one ascending run (an export into a buffer, an import out of one), there is
nothing to stage: each layer is one pass, an `index_select` straight into the
destination's run or an `index_copy_` straight out of the source's run (a
slice `copy_` when both are runs). Random ids on both sides have no single
torch op, so they take the two passes above through an L2-sized slot.
Caches whose blocks are not on dim 0 (flash: `[2, num_blocks, ...]`) are
split into blocks-first views per leading index, so every block stays a
contiguous row for the index kernels.

Staging slots form a ring (`depth`, default 2) and every hand-over between
streams or between a stream and the host goes through an event, so piece k+1
is gathered while piece k is in flight, and a slot is reused only after the
work that read it has finished. Device work is queued on dedicated streams
(which first wait for the caller's current stream); `copy_blocks` returns a
`CopyHandle` to wait on. On CPU tensors the same pipeline runs with host
operations in place of streams (`HostOps`): there is no separate toy path.

The stream seam and the handle are in `streams.py`, the views and pieces in
`pieces.py` (both re-exported here); export and import with per-block CRC-32
checksums (`export_blocks`, `import_blocks`) are `export.py`'s, on top of this.

This module must not know about HTTP or the wire format (`kv/wire.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv import native as _native
from dynamo_ftctl.kv.native import BAD_IDS, RUN_NONE
from dynamo_ftctl.kv.pieces import (
    Kind,
    Piece,
    as_rows,
    host_copy,
    kernel_copy,
    kind_of,
    same_storage,
    unbind_leading,
)
from dynamo_ftctl.kv.streams import (
    STAGING_POOL,
    CopyHandle,
    CudaOps,
    Event,
    HostOps,
    StagingPool,
    StreamOps,
)

if TYPE_CHECKING:
    import torch

    from dynamo_ftctl.kv.native import RowKernel

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "STAGING_POOL",
    "CopyHandle",
    "CudaOps",
    "Event",
    "HostOps",
    "Piece",
    "StagingPool",
    "StreamOps",
    "copy_blocks",
    "run_pipeline",
    "validate_block_ids",
]

# One staging slot per piece holds about this many bytes (rounded to whole
# blocks). 1 MiB keeps the CPU staging ring inside a core's L2 cache; see
# `ftctl kv bench` for the sweep that chose it.
DEFAULT_CHUNK_BYTES = 1 << 20


# ------------------------------------------------------------------ validation


def validate_block_ids(
    ids: Sequence[int] | torch.Tensor, num_blocks: int, what: str,
) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor; out-of-range, duplicate or non-integer ids are
    `InvalidInput`. Vectorized: validating 100k ids costs well under a millisecond."""
    return _validate(ids, num_blocks, what)[0]


def _validate(
    ids: Sequence[int] | torch.Tensor, num_blocks: int, what: str,
    kernel: RowKernel | None = None,
) -> tuple[torch.Tensor, int | None]:
    """`validate_block_ids`, and the first id when the ids are one ascending run
    (a, a+1, ..., a+n-1), else None. Ascending ids need no sort to prove them distinct.

    With the native `kernel`, one C pass checks them; otherwise (and to name a bad
    id) numpy does, on a zero-copy view: its calls cost about a microsecond where
    each torch op costs several, which a 1k-block copy of 4 MiB notices."""
    import numpy as np
    import torch

    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            msg = f"{what}: block ids must be a 1-D integer tensor"
            raise InvalidInput(msg)
        index = ids.to(device="cpu", dtype=torch.long).contiguous()
    else:
        bad_type = next((v for v in ids if isinstance(v, bool) or not isinstance(v, int)), None)
        if bad_type is not None:
            msg = f"{what}: block id {bad_type!r} is not an integer"
            raise InvalidInput(msg)
        index = torch.tensor(list(ids), dtype=torch.long)
    count = index.shape[0]
    if count == 0:
        return index, None
    if kernel is not None and (start := kernel.check_ids(index, num_blocks)) != BAD_IDS:
        return index, (None if start == RUN_NONE else start)
    arr = index.numpy()
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= num_blocks:
        first = int(arr[(arr < 0) | (arr >= num_blocks)][0])
        msg = f"{what}: block id {first} out of range [0, {num_blocks})"
        raise InvalidInput(msg)
    if count == 1 or bool((arr[1:] > arr[:-1]).all()):
        return index, (low if high - low == count - 1 else None)
    if _counting_pays(count, num_blocks):
        # Linear: one count per block of the cache, cheaper than sorting the ids here.
        seen = np.bincount(arr, minlength=num_blocks)
        if seen.max() > 1:
            msg = f"{what}: duplicate block id {int(np.flatnonzero(seen > 1)[0])}"
            raise InvalidInput(msg)
        return index, None
    ordered = np.sort(arr)
    repeats = ordered[1:] == ordered[:-1]
    if bool(repeats.any()):
        msg = f"{what}: duplicate block id {int(ordered[1:][repeats][0])}"
        raise InvalidInput(msg)
    return index, None


def _counting_pays(count: int, num_blocks: int) -> bool:
    """Whether one pass over a cache's `num_blocks` slots beats sorting `count` ids."""
    return num_blocks <= 16 * count + 4096


def _sorted_by(
    key: torch.Tensor, other: torch.Tensor, num_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`key` (distinct, validated ids of a cache of `num_blocks`) ascending, and `other`
    in the same order: a counting sort over the cache's blocks when the ids are dense
    enough, else argsort."""
    import numpy as np
    import torch

    k_arr = key.numpy()
    if _counting_pays(key.shape[0], num_blocks):
        slot = np.full(num_blocks, -1, dtype=np.int64)
        slot[k_arr] = np.arange(k_arr.shape[0], dtype=np.int64)
        order = slot[slot >= 0]
    else:
        order = np.argsort(k_arr)
    return torch.from_numpy(k_arr[order]), torch.from_numpy(other.numpy()[order])


def _check_caches(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], block_dim: int,
) -> None:
    if not src or len(src) != len(dst):
        msg = f"source has {len(src)} layers, destination {len(dst)} (need the same, >= 1)"
        raise InvalidInput(msg)
    for layer, (s, d) in enumerate(zip(src, dst, strict=True)):
        if not -s.dim() <= block_dim < s.dim():
            msg = f"layer {layer}: block_dim {block_dim} out of range for a {s.dim()}-D cache"
            raise InvalidInput(msg)
        s_block = s.shape[:block_dim] + s.shape[block_dim + 1:]
        d_block = d.shape[:block_dim] + d.shape[block_dim + 1:]
        if s.dtype != d.dtype or s_block != d_block or s.dim() != d.dim():
            msg = (f"layer {layer}: source block {tuple(s_block)} {s.dtype} does not match "
                   f"destination block {tuple(d_block)} {d.dtype}")
            raise InvalidInput(msg)
        for side, t, first in (("source", s, src[0]), ("destination", d, dst[0])):
            if t.shape[block_dim] != first.shape[block_dim]:
                msg = (f"{side} layer {layer}: {t.shape[block_dim]} blocks, "
                       f"layer 0 has {first.shape[block_dim]}")
                raise InvalidInput(msg)


# ----------------------------------------------------------------- the pipeline


def run_pipeline(
    pieces: Sequence[Piece],
    *,
    src_kind: Kind,
    dst_kind: Kind,
    ops: StreamOps,
    depth: int = 2,
    blocks: int = 0,
    crossing: bool | None = None,
) -> CopyHandle:
    """Run gather → copy → scatter over `pieces` with a ring of `depth` staging slots.

    `src_kind`/`dst_kind` say where each side lives ("host" work runs on the
    calling thread, "device" work is queued on streams) and `crossing` whether
    a copy between two staging buffers is needed (default: when the kinds or
    devices differ); `copy_blocks` derives them from the tensors' devices,
    tests pass them to drive fake streams.
    """
    import torch

    if depth < 2:
        msg = f"pipeline depth must be >= 2 (got {depth})"
        raise InvalidInput(msg)
    if not pieces:
        return CopyHandle(blocks=0, bytes=0, pieces=0)
    first = pieces[0]
    src_device, dst_device = first.src.device, first.dst.device
    if crossing is None:
        crossing = src_kind != dst_kind or (src_kind == "device" and src_device != dst_device)
    same = not crossing
    row_shape = tuple(first.src.shape[1:])
    dtype = first.src.dtype
    # Same-side pieces with a run of blocks on either side copy in one pass, unstaged.
    direct = [p.direct() for p in pieces] if same else []
    staged = [p for p, work in zip(pieces, direct, strict=True) if work is None] if same \
        else pieces
    row_bytes = first.src[0].numel() * first.src.element_size()
    moved = sum(p.src_ids.shape[0] for p in pieces)
    if same and not staged and src_kind == "host":
        # Host work, one pass per piece, nothing staged: no streams, events or slots to keep.
        for work in direct:
            ops.run(None, work)  # type: ignore[arg-type]
        return CopyHandle(blocks=blocks or moved, bytes=moved * row_bytes, pieces=len(pieces))
    slot_rows = max((p.src_ids.shape[0] for p in staged), default=0)
    slots = depth if staged else 0
    keep: list[Any] = [pieces]

    src_stream = ops.new_stream(src_device) if src_kind == "device" else None
    if same:
        dst_stream, copy_stream = src_stream, None
    else:
        dst_stream = ops.new_stream(dst_device) if dst_kind == "device" else None
        copy_stream = ops.new_stream(src_device if src_kind == "device" else dst_device)
    streams = [(s, d) for s, d in ((src_stream, src_device), (dst_stream, dst_device),
                                   (copy_stream, src_device if src_kind == "device"
                                    else dst_device)) if s is not None]
    for stream, device in streams:
        ops.join_current(stream, device)

    shape = (slot_rows, *row_shape)
    src_stage = [
        ops.staging(shape, dtype, src_device, pinned=src_kind == "host" and not same)
        for _ in range(slots)
    ]
    dst_stage = src_stage if same else [
        ops.staging(shape, dtype, dst_device, pinned=dst_kind == "host") for _ in range(slots)
    ]
    keep += [src_stage, dst_stage]
    for stream, _ in streams:
        for buf in (*src_stage, *dst_stage):
            ops.mark_used(buf, stream)
    # Index tensors were made on the caller's stream; ours read them later.
    for piece in pieces:
        ops.mark_used(piece.src_ids, src_stream)
        ops.mark_used(piece.dst_ids, dst_stream)

    def gather(piece: Piece, buf: torch.Tensor) -> Callable[[], None]:
        def work() -> None:
            torch.index_select(piece.src, 0, piece.src_ids, out=buf)
        return work

    def scatter(piece: Piece, buf: torch.Tensor) -> Callable[[], None]:
        def work() -> None:
            piece.dst.index_copy_(0, piece.dst_ids, buf)
        return work

    copied: list[Event | None] = [None] * depth  # last transfer that read src slot / wrote dst slot
    scattered: list[Event | None] = [None] * depth  # last device scatter that read dst slot
    pending: tuple[Piece, torch.Tensor, Event] | None = None  # host scatter waiting for its copy

    for index, piece in enumerate(pieces):
        if same and (work := direct[index]) is not None:
            ops.run(src_stream, work)
            continue
        slot = index % depth
        rows = piece.src_ids.shape[0]
        sbuf, dbuf = src_stage[slot][:rows], dst_stage[slot][:rows]
        if same:
            # One side, one stream (or the host): gather then scatter, in order.
            def both(piece: Piece = piece, sbuf: torch.Tensor = sbuf) -> None:
                gather(piece, sbuf)()
                scatter(piece, sbuf)()

            ops.run(src_stream, both)
            continue

        # 1. gather into the source slot, once the transfer that last read it is done.
        previous = copied[slot]
        if src_kind == "device":
            if previous is not None:
                ops.wait(src_stream, previous)
            ops.run(src_stream, gather(piece, sbuf))
            ops.wait(copy_stream, ops.record(src_stream))
        else:
            if previous is not None:
                previous.synchronize()
            gather(piece, sbuf)()

        # 2. copy into the destination slot, once the scatter that last read it is done.
        #    (A host scatter of this slot ran on an earlier iteration: depth >= 2.)
        if dst_kind == "device" and scattered[slot] is not None:
            ops.wait(copy_stream, scattered[slot])  # type: ignore[arg-type]
        ops.transfer(copy_stream, dbuf, sbuf)
        copied[slot] = ops.record(copy_stream)

        # 3. scatter into the destination blocks.
        if dst_kind == "device":
            ops.wait(dst_stream, copied[slot])  # type: ignore[arg-type]
            ops.run(dst_stream, scatter(piece, dbuf))
            scattered[slot] = ops.record(dst_stream)
        else:
            # Scatter the previous piece now that this one is queued behind it.
            if pending is not None:
                _host_scatter(pending, scatter)
            pending = (piece, dbuf, copied[slot])  # type: ignore[assignment]
    if pending is not None:
        _host_scatter(pending, scatter)

    events = tuple(ops.record(stream) for stream, _ in streams)
    total_blocks = blocks or moved
    buffers = list({id(b): b for b in (*src_stage, *dst_stage)}.values())
    handle = CopyHandle(
        blocks=total_blocks,
        bytes=moved * row_bytes,
        pieces=len(pieces),
        events=events,
        keep=keep,
        release=lambda: ops.release(buffers),
    )
    if not streams:
        handle.wait()  # all host work: finished already; recycle the staging at once
    return handle


def _host_scatter(
    pending: tuple[Piece, torch.Tensor, Event],
    scatter: Callable[[Piece, torch.Tensor], Callable[[], None]],
) -> None:
    piece, dbuf, event = pending
    event.synchronize()
    scatter(piece, dbuf)()


def _ops_for(src: torch.device, dst: torch.device) -> StreamOps:
    return CudaOps() if "cuda" in (src.type, dst.type) else HostOps()


def copy_blocks(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_ids: Sequence[int] | torch.Tensor,
    dst_ids: Sequence[int] | torch.Tensor,
    *,
    block_dim: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    depth: int = 2,
    ops: StreamOps | None = None,
    native: RowKernel | bool = True,
) -> CopyHandle:
    """Copy blocks `src_ids` of cache `src` to blocks `dst_ids` of cache `dst`.

    Caches are sequences of per-layer tensors with blocks on `block_dim`; they
    may live on the host or on CUDA devices (D2D, D2H, H2D). Block ids must be
    in range and distinct; when `src` and `dst` share storage, the two id
    lists must not overlap. Returns a handle; call `wait()` before reading the
    destination (on CPU the copy has finished when this returns).

    Host-to-host copies whose blocks are contiguous rows go through the native
    row-copy kernel (`kv.native`), one pass per layer whatever the ids, when the
    wheel ships it or a compiler built it on first use; `native=False` keeps to
    torch's kernels, a `RowKernel` picks that one.
    """
    import torch

    if chunk_bytes <= 0:
        msg = f"chunk_bytes must be > 0 (got {chunk_bytes})"
        raise InvalidInput(msg)
    kernel: RowKernel | None = None
    if native is not False:
        kernel = native if native is not True else _native.kernel()
        if kernel is not None and (handle := host_copy(kernel, src, dst, src_ids, dst_ids,
                                                        block_dim=block_dim)):
            return handle
    _check_caches(src, dst, block_dim)
    dim = block_dim % src[0].dim()
    src_device, dst_device = src[0].device, dst[0].device
    if src_device.type != "cpu" or dst_device.type != "cpu":
        kernel = None
    s_ids, s_start = _validate(src_ids, src[0].shape[dim], "source", kernel)
    d_ids, d_start = _validate(dst_ids, dst[0].shape[dim], "destination", kernel)
    count = s_ids.shape[0]
    if count != d_ids.shape[0]:
        msg = f"{count} source block ids but {d_ids.shape[0]} destination block ids"
        raise InvalidInput(msg)
    if any(same_storage(s, d) for s, d in zip(src, dst, strict=True)):
        both = s_ids[torch.isin(s_ids, d_ids)]
        if both.numel():
            msg = f"source and destination share a cache and both name block {int(both.min())}"
            raise InvalidInput(msg)
    if not count:
        return CopyHandle(blocks=0, bytes=0, pieces=0)

    if dim:
        # Blocks not first (flash: [2, num_blocks, ...]): each index of the leading dims
        # is its own blocks-first tensor (a view), so a block's bytes stay contiguous
        # rows for the index kernels' row-at-a-time fast paths.
        src, dst, dim = unbind_leading(src, dim), unbind_leading(dst, dim), 0
    if kernel is not None and (handle := kernel_copy(kernel, src, dst, s_ids, d_ids)) is not None:
        return handle

    src_rows, dst_rows = as_rows(src, dst, dim)
    row_bytes = src_rows[0][0].numel() * src_rows[0].element_size()
    chunk = max(1, chunk_bytes // max(1, row_bytes))
    if src_device == dst_device and (s_start is not None or d_start is not None):
        # One side is a run of blocks (an export into a buffer, an import out of one):
        # one index op per layer straight between the caches, no staging, no chunks.
        s_index, d_index = s_ids.to(src_device), d_ids.to(dst_device)
        pieces = [
            Piece(src=s, dst=d, src_ids=s_index, dst_ids=d_index, src_start=s_start,
                  dst_start=d_start)
            for s, d in zip(src_rows, dst_rows, strict=True)
        ]
    else:
        if dst_device.type == "cpu" and d_start is None:
            # Scatter in ascending destination order: host writes then stream through
            # memory (docs/benchmarks.md has the gain on the CPU bench).
            d_ids, s_ids = _sorted_by(d_ids, s_ids, dst[0].shape[0])
        s_index, d_index = s_ids.to(src_device), d_ids.to(dst_device)
        s_chunks = torch.split(s_index, chunk)
        d_chunks = torch.split(d_index, chunk)
        pieces = [
            Piece(src=s, dst=d, src_ids=si, dst_ids=di)
            for s, d in zip(src_rows, dst_rows, strict=True)
            for si, di in zip(s_chunks, d_chunks, strict=True)
        ]
    return run_pipeline(
        pieces, src_kind=kind_of(src_device), dst_kind=kind_of(dst_device),
        ops=ops or _ops_for(src_device, dst_device), depth=depth, blocks=count,
    )
