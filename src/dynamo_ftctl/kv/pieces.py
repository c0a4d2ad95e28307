"""How a block copy is cut up: caches as views of byte rows, and the pieces of work.

A cache's layers are viewed blocks-first as rows of their widest element type
(`as_rows`, `unbind_leading`), a copy is cut into `Piece`s (layer, chunk of
blocks), and a host copy that fits the native row-copy kernel skips the pieces
altogether (`host_copy`, `kernel_copy`). `copy.py` runs the pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dynamo_ftctl.kv.streams import CopyHandle

if TYPE_CHECKING:
    import torch

    from dynamo_ftctl.kv.native import RowKernel

__all__ = ["Kind", "Piece", "as_rows", "host_copy", "kernel_copy", "kind_of", "same_storage",
           "unbind_leading"]


Kind = Literal["host", "device"]


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()



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


def as_rows(
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


def unbind_leading(caches: Sequence[torch.Tensor], block_dim: int) -> list[torch.Tensor]:
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


def kernel_copy(
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


def host_copy(
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
            src, dst = unbind_leading(src, dim), unbind_leading(dst, dim)
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
                    or not (s.is_cpu and d.is_cpu) or same_storage(s, d)):
                return None
        return _native_copy(kernel, src, dst, src_ids, dst_ids, row_bytes=row * dtype.itemsize)
    except (RuntimeError, IndexError, TypeError):  # sparse or mkldnn layers, no layers
        return None


def kind_of(device: torch.device) -> Kind:
    return "host" if device.type == "cpu" else "device"
