"""The stream seam of the KV block copier: streams, events, staging buffers, the handle.

`StreamOps` is what the copy pipeline asks of a device: `CudaOps` on CUDA,
`HostOps` on CPU tensors (the same pipeline with host operations in place of
streams). `StagingPool` keeps staging buffers between copies; `CopyHandle` is
what a caller waits on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["STAGING_POOL", "CopyHandle", "CudaOps", "Event", "HostOps", "StagingPool",
           "StreamOps"]


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

    A fresh large host allocation page-faults on first touch (CPU copies with new
    slots each call are several times slower; docs/benchmarks.md) and pinned memory
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
