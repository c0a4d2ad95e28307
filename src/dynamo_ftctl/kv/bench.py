"""Bandwidth of the block copier against one contiguous `copy_` of the same bytes.

The baseline is the best a copy of that many bytes can do on the same route
(one `copy_` between two contiguous buffers: host memory, the device, or
pinned host memory across the bus), measured in the same run, with the same
torch thread count, and interleaved with the copier so that machine noise
hits both alike. Its buffers are the two caches' own memory (all layers of a
cache are one allocation), so a run needs no more memory than the caches.
The figure that matters is the ratio; it is given from wall time and from
the process's CPU time (which a busy shared host does not inflate by
descheduling: on one thread, the fairer of the two).

What the caches hold (`cache`). Each cache holds a quarter more blocks than
are copied; the copier reads its blocks scattered over the source cache and
writes them over the destination's, the baseline reads and writes the first
bytes of the same two allocations: the same bytes, in the same memory, with no
buffer of the baseline's own. "warm" (the default) runs both back to back:
whatever of that memory the last-level cache holds, it holds for both (1k
blocks of 4 KiB, two 5 MiB caches, fit a 32 MiB L3; 10k blocks and up fit for
neither). Its flaw: each run inherits the other's cache state, so the copier's
store kind moves the baseline (after streamed stores the lines the baseline
rewrites are not cached: 1k 4 KiB blocks, one thread, ~390 us instead of
~175 us), and the warm ratio of small copies says as much about that as about
the copier. "cold" reads twice the last-level cache (on one thread, no torch
op, which would leave torch's OpenMP threads spinning for the baseline only)
before every timed run of either, so both start from DRAM and neither sees the
other (its own flaw: cached stores' write-backs fall in the untimed eviction,
the baseline's always, the copier's below the streaming threshold). Neither
weakens one side for the other; benchmarks/kv.py prints both.

Three id patterns: `gather` (random source blocks into a run of destination
blocks: an export into a buffer), `scatter` (a run of source blocks into
random destination blocks: an import out of a buffer) and `random` (random
blocks to random blocks: a move between two caches). On the host the native
row-copy kernel (`kv.native`) copies all three in one pass per layer; with
torch's kernels (`kernel="torch"`, and on devices) the first two are one
index op per layer straight between the caches, and `random` has no single
torch op, so it gathers into an L2-sized staging slot and scatters from it
(two passes). A chunk-size sweep of `random` shows how the slot size trades
per-piece overhead against cache residency (torch's kernels only: the native
one stages nothing).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.clock import SYSTEM_CLOCK, Clock
from dynamo_ftctl.errors import InvalidInput, Unreachable
from dynamo_ftctl.kv.copy import DEFAULT_CHUNK_BYTES, copy_blocks
from dynamo_ftctl.kv.layout import LAYOUTS, CacheLayout, cache_shape, dtype_bytes

if TYPE_CHECKING:
    import torch
    from rich.console import Group

__all__ = ["CACHE_MODES", "KERNELS", "PATTERNS", "BenchRow", "KVBenchResult", "run_kv_bench"]

# Routes a device can run; on CPU only host-to-host exists.
CUDA_ROUTES = ("d2d", "d2h", "h2d")
# Which block ids are copied: see the module docstring.
PATTERNS = ("gather", "scatter", "random")
# Which host kernels copy: the native row-copy kernel when built ("auto"), or it or torch's.
KERNELS = ("auto", "native", "torch")
# What the host caches hold when a timed run starts: see the module docstring.
CACHE_MODES = ("warm", "cold")


@dataclass(frozen=True)
class BenchRow:
    """One measurement: the copier and the contiguous baseline on one route and size."""

    route: str
    pattern: str
    blocks: int
    layers: int
    block_bytes: int  # one block of one layer
    chunk_bytes: int
    bytes: int
    copier_s: float
    contiguous_s: float
    copier_gb_per_s: float
    contiguous_gb_per_s: float
    ratio: float  # copier bandwidth / contiguous bandwidth
    # The same ratio from the process's CPU time: what other processes on a shared
    # host do to the wall clock (descheduling) does not enter it.
    cpu_ratio: float


@dataclass(frozen=True)
class KVBenchResult:
    """Rows for each block count, then the chunk-size sweep."""

    device: str
    threads: int
    repeats: int
    layout: str
    kernel: str  # what copied host blocks: "native" (the row-copy kernel) or "torch"
    cache: str  # "warm" (runs back to back) or "cold" (host caches evicted before each)
    rows: tuple[BenchRow, ...]
    sweep: tuple[BenchRow, ...]

    def __rich__(self) -> Group:
        from rich.console import Group

        from dynamo_ftctl.output import table

        def render(title: str, rows: Sequence[BenchRow]) -> Any:
            return table(
                title,
                ["route", "ids", "blocks", "layers", "block", "chunk", "MiB", "copier GB/s",
                 "contiguous GB/s", "ratio", "CPU-time ratio"],
                [(r.route, r.pattern, r.blocks, r.layers, f"{r.block_bytes // 1024} KiB",
                  f"{r.chunk_bytes // 1024} KiB", round(r.bytes / 2**20, 1),
                  round(r.copier_gb_per_s, 2), round(r.contiguous_gb_per_s, 2),
                  round(r.ratio, 3), round(r.cpu_ratio, 3)) for r in rows],
            )

        caches = ("warm caches (runs back to back)" if self.cache == "warm" else
                  "cold caches (evicted before every timed run)")
        head = (f"device {self.device}, {self.layout} layout, {self.kernel} host kernel, "
                f"{self.threads} torch threads, {caches}: copier and baseline alike, "
                f"median of {self.repeats} interleaved runs")
        parts: list[Any] = [head, render("copier vs one contiguous copy_", self.rows)]
        if self.sweep:
            parts.append(render("chunk-size sweep of torch's kernels (the native one stages "
                                "nothing)", self.sweep))
        return Group(*parts)


def _timed(
    clock: Clock, cpu_clock: Callable[[], float], work: Callable[[], None],
    sync: Callable[[], None], evict: Callable[[], None] | None,
) -> tuple[float, float]:
    """Wall and CPU seconds of one run of `work` (after `evict`, untimed, when given)."""
    if evict is not None:
        evict()
    sync()
    start, cpu = clock.now(), cpu_clock()
    work()
    sync()
    return clock.now() - start, cpu_clock() - cpu


def _measure(
    *, route: str, pattern: str, device: torch.device, blocks: int, layers: int,
    layout: CacheLayout, block_shape: tuple[int, int, int], dtype: torch.dtype,
    chunk_bytes: int, repeats: int, clock: Clock, cpu_clock: Callable[[], float], seed: int,
    native: bool, evict: Callable[[], None] | None,
) -> BenchRow:
    import torch

    cuda = torch.device("cuda") if device.type == "cuda" else None
    src_dev = cuda if route in ("d2d", "d2h") and cuda else torch.device("cpu")
    dst_dev = cuda if route in ("d2d", "h2d") and cuda else torch.device("cpu")
    pin = cuda is not None
    gen = torch.Generator().manual_seed(seed)
    # Caches hold a quarter more blocks than are copied, ids drawn at random.
    total = blocks + max(1, blocks // 4)

    def cache(dev: torch.device) -> torch.Tensor:
        """All layers in one allocation (a layer is a view), filled with its layer number."""
        layered = torch.empty((layers, *cache_shape(layout, total, *block_shape)),
                              dtype=dtype, device=dev, pin_memory=pin and dev.type == "cpu")
        for layer in range(layers):
            layered[layer].fill_(layer)
        return layered

    src_all, dst_all = cache(src_dev), cache(dst_dev)
    src, dst = list(src_all.unbind(0)), list(dst_all.unbind(0))
    src_ids = torch.randperm(total, generator=gen)[:blocks]
    dst_ids = torch.randperm(total, generator=gen)[:blocks]
    run = torch.arange(blocks) + (total - blocks) // 2
    if pattern == "gather":
        dst_ids = run
    elif pattern == "scatter":
        src_ids = run
    block_bytes = src[0].select(layout.block_dim, 0).numel() * src[0].element_size()
    nbytes = blocks * layers * block_bytes
    flat = nbytes // 16 * 16
    # The baseline copies the first `flat` bytes of one cache's memory into the other's:
    # the same bytes, contiguous, with no buffers beside the caches.
    a = src_all.view(-1).view(torch.uint8)[:flat]
    b = dst_all.view(-1).view(torch.uint8)[:flat]

    def sync() -> None:
        if cuda is not None:
            torch.cuda.synchronize()

    def copier() -> None:
        copy_blocks(src, dst, src_ids, dst_ids, block_dim=layout.block_dim,
                    chunk_bytes=chunk_bytes, native=native).wait()

    def contiguous() -> None:
        b.copy_(a, non_blocking=cuda is not None)

    copier()
    contiguous()  # warm caches, page in, start the allocator
    copier_t, base_t = [], []
    for _ in range(repeats):
        copier_t.append(_timed(clock, cpu_clock, copier, sync, evict))
        base_t.append(_timed(clock, cpu_clock, contiguous, sync, evict))
    c, base = statistics.median(t for t, _ in copier_t), statistics.median(t for t, _ in base_t)
    c_cpu = statistics.median(t for _, t in copier_t)
    base_cpu = statistics.median(t for _, t in base_t)
    return BenchRow(
        route=route, pattern=pattern, blocks=blocks, layers=layers, block_bytes=block_bytes,
        chunk_bytes=chunk_bytes, bytes=nbytes, copier_s=c, contiguous_s=base,
        copier_gb_per_s=nbytes / c / 1e9, contiguous_gb_per_s=flat / base / 1e9,
        ratio=(nbytes / c) / (flat / base),
        cpu_ratio=(nbytes / c_cpu) / (flat / base_cpu) if c_cpu > 0 and base_cpu > 0 else 0.0,
    )


def run_kv_bench(
    *,
    device: str = "cpu",
    layers: int = 1,
    blocks: Sequence[int] = (1000, 10_000, 100_000),
    block_size: int = 16,
    kv_heads: int = 1,
    head_dim: int = 64,
    dtype: str = "fp16",
    layout: str = "vllm",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    sweep_chunks: Sequence[int] = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20),
    sweep_blocks: int = 10_000,
    patterns: Sequence[str] = PATTERNS,
    repeats: int = 5,
    threads: int | None = None,
    kernel: str = "auto",
    cache: str = "warm",
    clock: Clock = SYSTEM_CLOCK,
    cpu_clock: Callable[[], float] = time.process_time,
    evict: Callable[[], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> KVBenchResult:
    """Measure the copier against a contiguous copy for each id pattern and block count,
    then sweep chunk sizes on the `random` pattern (with torch's kernels, whatever
    `kernel` says: only their two-pass copy stages blocks in chunks).

    Blocks are `[2, block_size, kv_heads, head_dim]` per layer (default 16 × 1 × 64
    fp16 = 4 KiB) in a cache `layout` of `kv.layout.LAYOUTS`: vllm
    `[num_blocks, 2, ...]`, or flash `[2, num_blocks, ...]` (K and V of a block apart).
    On CUDA each size runs D2D, D2H and H2D; `Unreachable` (exit 3) when CUDA is
    asked for and no device is present. `kernel` picks the host copy kernel: "auto"
    (the native row-copy kernel when it was built at install), "native" (InvalidInput
    when it was not) or "torch". `cache` "cold" runs `evict` (default: a read of twice
    the last-level cache) before every timed run of the copier and the baseline.
    `on_progress(done, total)` follows the measurements.
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover (torch is in the sim extra)
        msg = "ftctl kv needs torch: pip install 'dynamo-ftctl[sim]'"
        raise InvalidInput(msg) from exc

    if device not in ("cpu", "cuda"):
        msg = f"--device must be cpu or cuda (got {device!r})"
        raise InvalidInput(msg)
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown or not patterns:
        given = ", ".join(unknown) or "none given"
        msg = f"--patterns: {given} (choose from {', '.join(PATTERNS)})"
        raise InvalidInput(msg)
    if device == "cuda" and not torch.cuda.is_available():
        msg = ("--device cuda: no CUDA device is available to this process "
               f"(torch {torch.__version__}, built for CUDA: {torch.version.cuda or 'no'})")
        raise Unreachable(msg)
    if kernel not in KERNELS:
        msg = f"--kernel: {kernel!r} (choose from {', '.join(KERNELS)})"
        raise InvalidInput(msg)
    from dynamo_ftctl.kv.native import kernel as installed_kernel

    native = kernel != "torch" and installed_kernel() is not None
    if kernel == "native" and not native:
        msg = ("--kernel native: the row-copy kernel is not available (neither in the wheel "
               "nor built on first use: no C compiler? FTCTL_KV_NATIVE=0 or FTCTL_NO_CACHE=1?)")
        raise InvalidInput(msg)
    if cache not in CACHE_MODES:
        msg = f"--cache: {cache!r} (choose from {', '.join(CACHE_MODES)})"
        raise InvalidInput(msg)
    if layout not in LAYOUTS:
        msg = f"--layout: {layout!r} (choose from {', '.join(LAYOUTS)})"
        raise InvalidInput(msg)
    if repeats < 1 or layers < 1 or any(n < 1 for n in blocks) or not blocks:
        msg = "--repeats, --layers and every --blocks value must be >= 1"
        raise InvalidInput(msg)
    if threads is not None:
        torch.set_num_threads(threads)
    torch_dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32}[dtype_bytes(dtype)]
    shape = (block_size, kv_heads, head_dim)
    dev = torch.device(device)
    routes = CUDA_ROUTES if device == "cuda" else ("h2h",)
    common: dict[str, Any] = {
        "device": dev, "layers": layers, "layout": LAYOUTS[layout], "block_shape": shape,
        "dtype": torch_dtype,
        "repeats": repeats, "clock": clock, "cpu_clock": cpu_clock, "native": native,
        "evict": (evict or _cache_evictor()) if cache == "cold" else None,
    }
    total = (len(patterns) * len(blocks) + len(sweep_chunks)) * len(routes)
    measured = 0

    def counted(row: BenchRow) -> BenchRow:
        nonlocal measured
        measured += 1
        if on_progress is not None:
            on_progress(measured, total)
        return row

    rows = tuple(
        counted(_measure(route=route, pattern=pattern, blocks=n, chunk_bytes=chunk_bytes,
                         seed=i, **common))
        for pattern in patterns for i, n in enumerate(blocks) for route in routes
    )
    # The staging chunk matters to torch's two-pass random copy only: the sweep measures it.
    sweep = tuple(
        counted(_measure(route=route, pattern="random", blocks=sweep_blocks, chunk_bytes=size,
                         seed=99, **{**common, "native": False}))
        for size in sweep_chunks for route in routes
    )
    return KVBenchResult(device=device, threads=torch.get_num_threads(), repeats=repeats,
                         layout=layout, kernel="native" if native else "torch", cache=cache,
                         rows=rows, sweep=sweep)


def _cache_evictor() -> Callable[[], None]:
    """Read twice the last-level cache's size (32 MiB where sysfs names none) on this
    thread: the caches then hold that buffer, clean, and none of the caches' lines. No
    torch op: it would leave torch's OpenMP threads spinning for the baseline."""
    from dynamo_ftctl.kv.native import last_level_cache_bytes

    # Written, not zeros: untouched zeroed pages all map to the one shared zero page.
    buffer = b"\x02" * (2 * (last_level_cache_bytes() or 32 << 20))

    def evict() -> None:
        buffer.find(b"\x01")  # memchr over every line; never found

    return evict
