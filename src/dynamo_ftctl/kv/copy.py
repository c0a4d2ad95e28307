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
handful of torch calls: `_host_copy`): a `memcpy`-sized copy per block,
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

Per-block CRC-32 checksums are computed on export (`export_blocks`) and
verified on import (`import_blocks`) before a single byte is written.

This module must not know about HTTP or the wire format (`kv/wire.py`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.kv import native as _native
from dynamo_ftctl.kv.native import BAD_IDS, RUN_NONE

if TYPE_CHECKING:
    import torch

    from dynamo_ftctl.kv.native import RowKernel

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "STAGING_POOL",
    "CopyHandle",
    "CudaOps",
    "Event",
    "ExportedBlocks",
    "HostOps",
    "KVChecksumError",
    "Piece",
    "StagingPool",
    "StreamOps",
    "block_checksums",
    "copy_blocks",
    "export_blocks",
    "import_blocks",
    "run_pipeline",
    "validate_block_ids",
]

# One staging slot per piece holds about this many bytes (rounded to whole
# blocks). 1 MiB keeps the CPU staging ring inside a core's L2 cache; see
# `ftctl kv bench` for the sweep that chose it.
DEFAULT_CHUNK_BYTES = 1 << 20

Kind = Literal["host", "device"]


class KVChecksumError(InvalidInput):
    """An imported block's bytes do not match the checksum computed at export."""


# ---------------------------------------------------------------- stream seam


class Event(Protocol):
    """A point in a stream's work that the host or another stream can wait for."""

    def synchronize(self) -> None:
        """Block the host until the work before the event has finished."""
        ...

    def query(self) -> bool:
        """True when the work before the event has finished."""
        ...


class StreamOps(Protocol):
    """The only seam between the pipeline and a device runtime (CUDA, host, fakes)."""

    def new_stream(self, device: torch.device) -> Any:
        """A dedicated stream on `device` (None on the host)."""
        ...

    def join_current(self, stream: Any, device: torch.device) -> None:
        """Make `stream` wait for the caller's current stream on `device`."""
        ...

    def run(self, stream: Any, work: Callable[[], None]) -> None:
        """Queue device work (kernels) on `stream`."""
        ...

    def transfer(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src, non_blocking=True)` on `stream`."""
        ...

    def record(self, stream: Any) -> Event:
        """An event after all work queued on `stream` so far."""
        ...

    def wait(self, stream: Any, event: Event) -> None:
        """Make `stream` wait for `event` without blocking the host."""
        ...

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, pinned: bool,
    ) -> torch.Tensor:
        """A staging buffer; `pinned` asks for page-locked host memory."""
        ...

    def mark_used(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that `tensor` is used on `stream` (keeps it from early reuse)."""
        ...

    def release(self, buffers: Sequence[torch.Tensor]) -> None:
        """Staging buffers whose work has finished: they may serve the next copy."""
        ...


class StagingPool:
    """Host staging buffers kept for reuse between copies.

    A fresh large host allocation page-faults on first touch (measured: 1k-block
    CPU copies ran 5x slower with new 1 MiB slots each call) and pinned memory
    costs a driver call, so buffers come back here when their copy is done.
    Thread-safe; keeps at most `per_key` buffers per (shape, dtype, pinned).
    """

    def __init__(self, per_key: int = 4) -> None:
        import threading

        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._per_key = per_key

    @staticmethod
    def _key(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> tuple[Any, ...]:
        return (tuple(shape), dtype, pinned)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """A host buffer of this shape: a pooled one, or a new one."""
        import torch

        with self._lock:
            free = self._free.get(self._key(shape, dtype, pinned))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a host buffer (only once nothing reads or writes it any more)."""
        key = self._key(tuple(buffer.shape), buffer.dtype, buffer.is_pinned())
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < self._per_key and all(b is not buffer for b in free):
                free.append(buffer)


STAGING_POOL = StagingPool()


class _DoneEvent:
    """The event of host work: it has finished by the time anyone can ask."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DONE = _DoneEvent()


class HostOps:
    """Stream operations for CPU tensors: everything runs at once on the calling thread."""

    def new_stream(self, device: torch.device) -> Any:  # noqa: ARG002 (protocol)
        return None

    def join_current(self, stream: Any, device: torch.device) -> None:  # noqa: ARG002
        return None

    def run(self, stream: Any, work: Callable[[], None]) -> None:  # noqa: ARG002 (protocol)
        work()

    def transfer(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:  # noqa: ARG002
        dst.copy_(src)

    def record(self, stream: Any) -> Event:  # noqa: ARG002 (protocol)
        return _DONE

    def wait(self, stream: Any, event: Event) -> None:  # noqa: ARG002 (protocol)
        return None

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, pinned: bool,
    ) -> torch.Tensor:
        del pinned, device  # no page-locking without a device to DMA to; always the host
        return STAGING_POOL.take(shape, dtype, pinned=False)

    def mark_used(self, tensor: torch.Tensor, stream: Any) -> None:  # noqa: ARG002 (protocol)
        return None

    def release(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer in buffers:
            STAGING_POOL.give(buffer)


class CudaOps:
    """Stream operations on CUDA: dedicated `torch.cuda.Stream`s, events, pinned staging."""

    def new_stream(self, device: torch.device) -> Any:
        import torch

        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def join_current(self, stream: Any, device: torch.device) -> None:
        import torch

        # The caller's kernels may still be writing the source blocks.
        stream.wait_stream(torch.cuda.current_stream(device))

    def _context(self, stream: Any) -> AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def run(self, stream: Any, work: Callable[[], None]) -> None:
        with self._context(stream):
            work()

    def transfer(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._context(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Event:
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, pinned: bool,
    ) -> torch.Tensor:
        import torch

        if device.type == "cpu":
            return STAGING_POOL.take(shape, dtype, pinned=pinned)
        # Device buffers come from torch's caching allocator, which already reuses them.
        return torch.empty(shape, dtype=dtype, device=device)

    def mark_used(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda and stream is not None:
            tensor.record_stream(stream)

    def release(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer in buffers:
            if buffer.device.type == "cpu":
                STAGING_POOL.give(buffer)


# ------------------------------------------------------------------ the handle


@dataclass
class CopyHandle:
    """A copy in flight: `wait()` blocks until every block has landed."""

    blocks: int
    bytes: int
    pieces: int
    events: tuple[Event, ...] = ()
    # Staging buffers and index tensors used by queued work, kept alive until wait().
    keep: list[Any] = field(default_factory=list, repr=False)
    # Called once the work has finished: hands the staging buffers back to the pool.
    release: Callable[[], None] | None = field(default=None, repr=False)

    def done(self) -> bool:
        """True when the copy has finished (never blocks)."""
        return all(event.query() for event in self.events)

    def wait(self) -> CopyHandle:
        """Block until the copy has finished; returns self."""
        for event in self.events:
            event.synchronize()
        self.keep.clear()
        if self.release is not None:
            release, self.release = self.release, None
            release()
        return self


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
        # Linear: one count per block of the cache (a 10k-id sort costs ~1 ms, this ~30 us).
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


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


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


# ------------------------------------------------------------ views and pieces

# Widest element types first: the gather/scatter kernels move one element per
# step, so viewing a block's bytes as 16-byte elements cuts their work 8x for fp16.
_WIDE_DTYPES = ("complex128", "int64", "int32", "int16", "uint8")


def _fold_level(v: torch.Tensor) -> int:
    """How many leading dims of `v` must stay so the rest folds into one contiguous dim."""
    if v.dim() > 1 and v.shape[0] and v[0].is_contiguous():
        return 1  # the common case, without a failed view per dim
    for keep in range(1, v.dim()):
        try:
            v.view(*v.shape[:keep], -1)
        except RuntimeError:
            continue
        return keep
    return v.dim()


def _fold(v: torch.Tensor, keep: int) -> torch.Tensor:
    return v.view(*v.shape[:keep], -1) if keep < v.dim() else v.unsqueeze(-1)


def _widest(views: Sequence[torch.Tensor]) -> torch.dtype:
    import torch

    for name in _WIDE_DTYPES:
        wide: torch.dtype = getattr(torch, name)
        size = wide.itemsize
        if all(
            v.shape[-1] * v.element_size() % size == 0
            and v.stride(-1) == 1
            and v.storage_offset() * v.element_size() % size == 0
            and all(st * v.element_size() % size == 0 for st in v.stride()[:-1])
            for v in views
        ):
            return wide
    return views[0].dtype  # the trailing dim is strided: keep the cache's own dtype


def _as_rows(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], block_dim: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer with blocks on dim 0 and as many trailing bytes as possible in one dim.

    Both sides get the same row shape (the coarsest fold that all of them
    allow), viewed as the widest element type their strides permit.
    """
    src_v = [t.movedim(block_dim, 0) for t in src] if block_dim else list(src)
    dst_v = [t.movedim(block_dim, 0) for t in dst] if block_dim else list(dst)
    keep = max(_fold_level(v) for v in (*src_v, *dst_v))
    src_r = [_fold(v, keep) for v in src_v]
    dst_r = [_fold(v, keep) for v in dst_v]
    wide = _widest([*src_r, *dst_r])
    return [r.view(wide) for r in src_r], [r.view(wide) for r in dst_r]


def _byte_rows(layers: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Blocks-first layers as 2-D views with one contiguous row per block (what the native
    kernel copies), or None when a block's bytes are not contiguous in some layer."""
    rows = []
    for t in layers:
        if not t[0].is_contiguous():
            return None
        rows.append(t.view(t.shape[0], -1))
    return rows


def _unbind_leading(caches: Sequence[torch.Tensor], block_dim: int) -> list[torch.Tensor]:
    """Views of `caches` with every index of the dims before `block_dim` split off."""
    out = list(caches)
    for _ in range(block_dim):
        out = [part for t in out for part in t.unbind(0)]
    return out


@dataclass(frozen=True)
class Piece:
    """One unit of the pipeline: a chunk of blocks of one layer."""

    src: torch.Tensor  # the layer's source rows: blocks on dim 0
    dst: torch.Tensor  # the layer's destination rows
    src_ids: torch.Tensor  # on the source's device
    dst_ids: torch.Tensor  # on the destination's device
    # Set when the ids are one ascending run starting here: that side is a plain
    # slice, so a same-device copy needs one pass (no staging) instead of two.
    src_start: int | None = None
    dst_start: int | None = None

    def direct(self) -> Callable[[], None] | None:
        """The one-pass copy of this piece when one side is a run of blocks, else None."""
        import torch

        rows = self.src_ids.shape[0]
        src, dst, s0, d0 = self.src, self.dst, self.src_start, self.dst_start
        if d0 is None and s0 is None:
            return None

        def work() -> None:
            if d0 is not None and s0 is not None:
                dst[d0 : d0 + rows].copy_(src[s0 : s0 + rows])
            elif d0 is not None:  # gather straight into the destination's run
                torch.index_select(src, 0, self.src_ids, out=dst[d0 : d0 + rows])
            elif s0 is not None:  # scatter straight from the source's run
                dst.index_copy_(0, self.dst_ids, src[s0 : s0 + rows])

        return work


def _kernel_copy(
    kernel: RowKernel, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
    s_ids: torch.Tensor, d_ids: torch.Tensor,
) -> CopyHandle | None:
    """Host to host through the native kernel, for validated ids: one pass per layer for
    any ids, nothing staged (None when a block's bytes are not contiguous: torch's
    kernels then copy). The kernel orders the rows (`RowKernel.copy_blocks`)."""
    src_rows, dst_rows = _byte_rows(src), _byte_rows(dst)
    if src_rows is None or dst_rows is None:
        return None
    return _native_copy(kernel, src_rows, dst_rows, s_ids, d_ids,
                        row_bytes=src_rows[0].shape[1] * src_rows[0].element_size())


def _native_copy(
    kernel: RowKernel, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
    s_ids: torch.Tensor, d_ids: torch.Tensor, *, row_bytes: int,
) -> CopyHandle | None:
    """Rows `s_ids` of every layer of `src` (blocks-first host tensors, each block's
    `row_bytes` contiguous, one dtype) to rows `d_ids` of `dst`, in one kernel call;
    None when the kernel refused the ids or ran out of memory (it copied nothing)."""
    import torch

    size = src[0].dtype.itemsize
    at = [t.data_ptr() for t in dst] + [t.data_ptr() for t in src] \
        + [t.stride(0) * size for t in dst] + [t.stride(0) * size for t in src]
    if kernel.copy_blocks(at, d_ids, s_ids, dst_blocks=dst[0].shape[0],
                          src_blocks=src[0].shape[0], row_bytes=row_bytes,
                          threads=torch.get_num_threads()):
        return None
    count = s_ids.shape[0]
    return CopyHandle(blocks=count, bytes=count * row_bytes * len(src), pieces=len(src))


def _row_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of one contiguous block of a blocks-first cache of `shape`."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape[1:]):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _host_copy(
    kernel: RowKernel, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
    src_ids: object, dst_ids: object, *, block_dim: int,
) -> CopyHandle | None:
    """The common host copy with as few torch calls as it takes, or None when the copy
    is anything but common: the general path then copies it, or names what is wrong.

    Common: every layer of a side (or, blocks not first, every blocks-first view
    per leading index) a host tensor of that side's layer 0 shape, strides and
    dtype, both sides' blocks alike and contiguous, no layer sharing storage with
    its counterpart, ids 1-D contiguous int64 host tensors (the kernel
    checks their range and repeats, and the general path names a bad one).

    Why: a migration copies once, from memory the caches no longer hold, where each
    torch call costs 10-50 us of cache misses. The general path's ~40 calls cost a
    1k-block copy of 4 KiB blocks ~300 us more than a contiguous `copy_` of the same
    bytes (`ftctl kv bench --cache cold`)."""
    import torch

    i64 = torch.int64
    try:
        if not (src[0].is_cpu and dst[0].is_cpu):
            return None  # a device copy: nothing to split or check here
        if block_dim:
            dim = block_dim % src[0].dim()
            src, dst = _unbind_leading(src, dim), _unbind_leading(dst, dim)
        s0, d0 = src[0], dst[0]
        shape, stride, dtype = s0.shape, s0.stride(), s0.dtype
        d_shape, d_stride = d0.shape, d0.stride()
        row = math.prod(shape[1:])  # elements of a block; its rows must not overlap
        if (
            len(src) != len(dst) or shape[1:] != d_shape[1:] or row <= 0
            or stride[0] < row or d_stride[0] < row
            or stride[1:] != d_stride[1:] or stride[1:] != _row_strides(shape)
            or not isinstance(src_ids, torch.Tensor) or not isinstance(dst_ids, torch.Tensor)
            or src_ids.dtype != i64 or dst_ids.dtype != i64
            or len(src_ids.shape) != 1 or src_ids.shape != dst_ids.shape
            or not (src_ids.is_cpu and dst_ids.is_cpu)
            or not (src_ids.is_contiguous() and dst_ids.is_contiguous())
        ):
            return None
        for s, d in zip(src, dst, strict=True):
            if (s.shape != shape or d.shape != d_shape or s.stride() != stride
                    or d.stride() != d_stride or s.dtype != dtype or d.dtype != dtype
                    or not (s.is_cpu and d.is_cpu) or _same_storage(s, d)):
                return None
        return _native_copy(kernel, src, dst, src_ids, dst_ids, row_bytes=row * dtype.itemsize)
    except (RuntimeError, IndexError, TypeError):  # sparse or mkldnn layers, no layers
        return None


def _kind(device: torch.device) -> Kind:
    return "host" if device.type == "cpu" else "device"


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
    row-copy kernel (`kv.native`), one pass per layer whatever the ids, when it
    was built at install; `native=False` keeps to torch's kernels, a `RowKernel`
    picks that one.
    """
    import torch

    if chunk_bytes <= 0:
        msg = f"chunk_bytes must be > 0 (got {chunk_bytes})"
        raise InvalidInput(msg)
    kernel: RowKernel | None = None
    if native is not False:
        kernel = native if native is not True else _native.kernel()
        if kernel is not None and (handle := _host_copy(kernel, src, dst, src_ids, dst_ids,
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
    if any(_same_storage(s, d) for s, d in zip(src, dst, strict=True)):
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
        src, dst, dim = _unbind_leading(src, dim), _unbind_leading(dst, dim), 0
    if kernel is not None and (handle := _kernel_copy(kernel, src, dst, s_ids, d_ids)) is not None:
        return handle

    src_rows, dst_rows = _as_rows(src, dst, dim)
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
            # memory (measured: +30-50% on the 100k-block CPU bench).
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
        pieces, src_kind=_kind(src_device), dst_kind=_kind(dst_device),
        ops=ops or _ops_for(src_device, dst_device), depth=depth, blocks=count,
    )


# ------------------------------------------------------------ export / import


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
) -> ExportedBlocks:
    """Copy `block_ids` out of `caches` into host memory and checksum every block."""
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
