"""The block copier: bit-exact copies, id validation, checksums, and the stream discipline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dynamo_ftctl.errors import InvalidInput  # noqa: E402
from dynamo_ftctl.kv import native  # noqa: E402
from dynamo_ftctl.kv.copy import (  # noqa: E402
    CopyHandle,
    HostOps,
    Piece,
    copy_blocks,
    run_pipeline,
)
from dynamo_ftctl.kv.export import (  # noqa: E402
    KVChecksumError,
    block_checksums,
    export_blocks,
    import_blocks,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]


@pytest.fixture(scope="session", params=["torch", "native"])
def kernel(request: Any) -> Any:
    """Each host copy test runs twice: on torch's kernels (`native=False`, the fallback
    when no compiler was there at install) and on the C row-copy kernel."""
    return False if request.param == "torch" else request.getfixturevalue("row_kernel")


@pytest.fixture
def default_kernel(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`kernel`, also as the one callers get without asking (export/import, the sim)."""
    monkeypatch.setattr(native, "kernel", lambda: kernel or None)
    return kernel


def make_cache(
    layers: int, blocks: int, *, block_dim: int = 0, dtype: Any = torch.float16, seed: int = 0,
    block_size: int = 4, heads: int = 2, head_dim: int = 8,
) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    shape = [blocks, 2, block_size, heads, head_dim]
    if block_dim == 1:
        shape = [2, blocks, block_size, heads, head_dim]
    out = []
    for _ in range(layers):
        raw = torch.randint(0, 256, (*shape[:-1], head_dim * torch.empty(0, dtype=dtype)
                                     .element_size()), dtype=torch.uint8, generator=gen)
        out.append(raw.view(dtype))
    return out


def expected_copy(src: list[Any], dst: list[Any], sids: list[int], dids: list[int],
                  block_dim: int = 0) -> list[Any]:
    want = [d.clone() for d in dst]
    for s, w in zip(src, want, strict=True):
        for a, b in zip(sids, dids, strict=True):
            w.select(block_dim, b).copy_(s.select(block_dim, a))
    return want


def bits_equal(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b,
                                                                                     strict=True))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    layers=st.integers(1, 3),
    src_blocks=st.integers(1, 40),
    dst_blocks=st.integers(1, 40),
    block_dim=st.sampled_from([0, 1]),
    dtype_index=st.integers(0, len(DTYPES) - 1),
    chunk_bytes=st.sampled_from([1, 300, 1024, 1 << 20]),
    depth=st.integers(2, 4),
    tensor_ids=st.booleans(),
)
def test_random_copies_are_bit_exact(
    kernel: Any, data: Any, layers: int, src_blocks: int, dst_blocks: int, block_dim: int,
    dtype_index: int, chunk_bytes: int, depth: int, tensor_ids: bool,
) -> None:
    """Any valid block lists (Python lists, or int64 tensors: the host kernel's short path),
    layouts, dtypes, chunk sizes and depths copy bit for bit."""
    dtype = DTYPES[dtype_index]
    count = data.draw(st.integers(0, min(src_blocks, dst_blocks)))
    sids = data.draw(st.permutations(range(src_blocks)))[:count]
    dids = data.draw(st.permutations(range(dst_blocks)))[:count]
    src = make_cache(layers, src_blocks, block_dim=block_dim, dtype=dtype, seed=1)
    dst = make_cache(layers, dst_blocks, block_dim=block_dim, dtype=dtype, seed=2)
    want = expected_copy(src, dst, sids, dids, block_dim)
    ids: tuple[Any, Any] = (sids, dids)
    if tensor_ids:
        ids = (torch.tensor(sids, dtype=torch.long), torch.tensor(dids, dtype=torch.long))
    handle = copy_blocks(src, dst, *ids, block_dim=block_dim, chunk_bytes=chunk_bytes,
                         depth=depth, native=kernel)
    assert handle.wait().done()
    assert handle.blocks == count
    assert bits_equal(dst, want)


def test_copy_within_one_cache_moves_blocks(kernel: Any) -> None:
    """Copying between disjoint block sets of the same cache is allowed and exact."""
    cache = make_cache(2, 10)
    want = expected_copy(cache, cache, [0, 1, 9, 2], [7, 8, 3, 5])
    copy_blocks(cache, cache, [0, 1, 9, 2], [7, 8, 3, 5], native=kernel).wait()
    assert bits_equal(cache, want)


def test_blocks_that_are_not_contiguous_copy_exactly(kernel: Any) -> None:
    """A cache whose blocks are strided views (last two dims swapped) is not the kernel's:
    torch's kernels copy it, bit for bit."""
    src = [t.transpose(-1, -2) for t in make_cache(2, 12, seed=51)]
    dst = [t.transpose(-1, -2) for t in make_cache(2, 12, seed=52)]
    assert not src[0][0].is_contiguous()
    want = expected_copy(src, dst, [11, 0, 5], [3, 9, 1])
    handle = copy_blocks(src, dst, [11, 0, 5], [3, 9, 1], chunk_bytes=1, native=kernel)
    assert handle.pieces == 2 * 3  # staged per block and layer: not the one-pass kernel
    assert bits_equal([t.contiguous() for t in dst], [t.contiguous() for t in want])


def test_handle_counts_bytes_and_pieces(kernel: Any) -> None:
    """The handle reports the blocks, payload bytes and pieces it moved: torch's kernels
    stage random ids in chunks, the row-copy kernel takes each layer in one pass."""
    src, dst = make_cache(3, 8), make_cache(3, 8, seed=5)
    block_bytes = src[0][0].numel() * src[0].element_size()
    handle = copy_blocks(src, dst, [1, 3, 5, 7], [6, 4, 2, 0], chunk_bytes=2 * block_bytes,
                         native=kernel)
    pieces = 3 if kernel else 3 * 2
    assert (handle.blocks, handle.bytes, handle.pieces) == (4, 3 * 4 * block_bytes, pieces)


@pytest.mark.parametrize(
    ("sids", "dids"),
    [([7, 2, 5], [3, 4, 5]), ([3, 4, 5], [7, 2, 5]), ([1, 2, 3], [6, 7, 8])],
    ids=["gather-into-run", "scatter-from-run", "run-to-run"],
)
@pytest.mark.parametrize("block_dim", [0, 1])
def test_a_run_of_blocks_copies_in_one_pass_per_layer(
    kernel: Any, sids: list[int], dids: list[int], block_dim: int,
) -> None:
    """When either id list is one ascending run, each layer (each K/V half in the flash
    layout) is one unstaged piece, bit-exact."""
    src = make_cache(3, 10, seed=41, block_dim=block_dim)
    dst = make_cache(3, 10, seed=42, block_dim=block_dim)
    want = expected_copy(src, dst, sids, dids, block_dim)
    staged: list[tuple[int, ...]] = []

    class CountingHostOps(HostOps):
        def staging(self, shape: tuple[int, ...], dtype: Any, device: Any, *,
                    pinned: bool) -> Any:
            staged.append(shape)
            return super().staging(shape, dtype, device, pinned=pinned)

    handle = copy_blocks(src, dst, sids, dids, block_dim=block_dim, chunk_bytes=1,
                         ops=CountingHostOps(), native=kernel)
    # One per layer (flash: per layer and K/V, each blocks-first), despite one-block chunks.
    assert handle.pieces == 3 * (2 if block_dim else 1)
    assert staged == []  # no staging buffer was asked for
    assert bits_equal(dst, want)


@pytest.mark.parametrize(
    ("sids", "dids", "needle"),
    [
        ([0, 1, 1], [2, 3, 4], "source: duplicate block id 1"),
        ([0, 1, 2], [5, 5, 6], "destination: duplicate block id 5"),
        ([0, 10], [1, 2], "source: block id 10 out of range [0, 10)"),
        ([0, 1], [-1, 2], "destination: block id -1 out of range"),
        ([0, 1], [2], "2 source block ids but 1 destination"),
        ([0, 1.0], [2, 3], "not an integer"),
    ],
)
@pytest.mark.parametrize("form", ["list", "tensor"])
def test_bad_block_ids_are_rejected(
    kernel: Any, sids: list[Any], dids: list[Any], needle: str, form: str,
) -> None:
    """Duplicate, out-of-range, non-integer or mismatched id lists raise InvalidInput,
    with the same words whether the ids come as lists or as tensors (which the host
    kernel's short path checks first), and nothing is written."""
    if form == "tensor":
        if any(isinstance(v, float) for v in sids):
            needle = "source: block ids must be a 1-D integer tensor"
        sids, dids = torch.tensor(sids), torch.tensor(dids)
    src, dst = make_cache(2, 10), make_cache(2, 10, seed=3)
    before = [d.clone() for d in dst]
    with pytest.raises(InvalidInput, match=needle.replace("[", r"\[").replace(")", r"\)")):
        copy_blocks(src, dst, sids, dids, native=kernel)
    assert bits_equal(dst, before)


@pytest.mark.parametrize("spread", [1, 1000], ids=["dense", "sparse"])
def test_duplicates_are_found_by_counting_and_by_sorting(spread: int) -> None:
    """Duplicate ids are refused, naming the smallest repeated one, both when the ids are
    dense (counted) and when they are few in a large cache (sorted)."""
    blocks = 64 * spread
    src = [torch.zeros(blocks, 16, dtype=torch.uint8)]
    dst = [torch.zeros(blocks, 16, dtype=torch.uint8)]
    ids = [9 * spread, 5 * spread, 9 * spread, 2 * spread, 5 * spread]
    with pytest.raises(InvalidInput, match=f"source: duplicate block id {5 * spread}$"):
        copy_blocks(src, dst, ids, range(5))
    sids = [3 * spread, 60 * spread, 0, 7 * spread]
    copy_blocks(src, dst, sids, [1, 0, 3, 2]).wait()  # distinct: accepted either way


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_overlapping_ids_in_one_cache_are_rejected(kernel: Any, form: str) -> None:
    """When source and destination share storage, a block named on both sides is refused."""
    cache = make_cache(2, 10)
    before = [c.clone() for c in cache]
    sids, dids = ([1, 3], [3, 4]) if form == "list" else (torch.tensor([1, 3]),
                                                          torch.tensor([3, 4]))
    with pytest.raises(InvalidInput, match="share a cache and both name block 3"):
        copy_blocks(cache, cache, sids, dids, native=kernel)
    assert bits_equal(cache, before)


def test_the_common_host_copy_skips_the_general_path(
    row_kernel: native.RowKernel, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM-shaped host caches and int64 tensor ids go to the kernel in one call, without
    the general path's checks and views (each torch call costs tens of microseconds from
    cold caches); anything unusual still takes the general path."""
    from dynamo_ftctl.kv import copy as kv_copy

    general: list[str] = []
    real = kv_copy._check_caches

    def counting(*args: Any, **kwargs: Any) -> None:
        general.append("checked")
        real(*args, **kwargs)

    monkeypatch.setattr(kv_copy, "_check_caches", counting)
    src, dst = make_cache(3, 20, seed=61), make_cache(3, 20, seed=62)
    sids, dids = [19, 0, 7, 3], [2, 11, 5, 18]
    want = expected_copy(src, dst, sids, dids)
    handle = copy_blocks(src, dst, torch.tensor(sids), torch.tensor(dids), native=row_kernel)
    assert (handle.blocks, handle.pieces) == (4, 3)
    assert bits_equal(dst, want)
    assert general == []
    # The flash layout ([2, num_blocks, ...]) too: its K and V halves are blocks-first views.
    f_src, f_dst = make_cache(2, 20, block_dim=1, seed=65), make_cache(2, 20, block_dim=1, seed=66)
    want = expected_copy(f_src, f_dst, sids, dids, block_dim=1)
    handle = copy_blocks(f_src, f_dst, torch.tensor(sids), torch.tensor(dids), block_dim=1,
                         native=row_kernel)
    assert (handle.blocks, handle.pieces) == (4, 2 * 2)
    assert bits_equal(f_dst, want)
    assert general == []
    # Unusual: int32 ids, a Python list, a layer strided unlike layer 0, caches that share
    # storage, blocks that overlap in memory (an expanded cache). Each copies exactly
    # through the general path.
    odd_layers = [*make_cache(2, 20, seed=63), make_cache(1, 40, seed=64)[0][::2]]
    expanded = [c[:1].expand(20, *c.shape[1:]) for c in src]
    cases: list[tuple[Any, Any, Any, Any]] = [
        (src, dst, torch.tensor(sids, dtype=torch.int32), torch.tensor(dids)),
        (src, dst, sids, dids),
        (odd_layers, dst, torch.tensor(sids), torch.tensor(dids)),
        (src, src, torch.tensor([1, 2]), torch.tensor([5, 6])),
        (expanded, dst, torch.tensor(sids), torch.tensor(dids)),
    ]
    for case_src, case_dst, case_sids, case_dids in cases:
        general.clear()
        want = expected_copy(case_src, case_dst, case_sids.tolist() if hasattr(
            case_sids, "tolist") else case_sids, case_dids.tolist() if hasattr(
            case_dids, "tolist") else case_dids)
        copy_blocks(case_src, case_dst, case_sids, case_dids, native=row_kernel).wait()
        assert bits_equal(case_dst, want)
        assert general == ["checked"]


def test_mismatched_caches_are_rejected() -> None:
    """Layer counts, block shapes and dtypes must agree between source and destination."""
    with pytest.raises(InvalidInput, match="layers"):
        copy_blocks(make_cache(2, 4), make_cache(1, 4), [0], [0])
    with pytest.raises(InvalidInput, match="does not match"):
        copy_blocks(make_cache(1, 4), make_cache(1, 4, heads=4), [0], [0])
    with pytest.raises(InvalidInput, match="does not match"):
        copy_blocks(make_cache(1, 4), make_cache(1, 4, dtype=torch.float32), [0], [0])
    with pytest.raises(InvalidInput, match="ids must be a 1-D integer tensor"):
        copy_blocks(make_cache(1, 4), make_cache(1, 4), torch.tensor([0.0]), [0])


def test_tensor_ids_are_accepted() -> None:
    """Block ids may be integer tensors as well as lists."""
    src, dst = make_cache(1, 6), make_cache(1, 6, seed=9)
    want = expected_copy(src, dst, [5, 0], [1, 2])
    copy_blocks(src, dst, torch.tensor([5, 0]), torch.tensor([1, 2], dtype=torch.int32)).wait()
    assert bits_equal(dst, want)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_export_import_round_trip_is_exact(default_kernel: Any, block_dim: int) -> None:
    """Export then import moves blocks exactly, with one CRC-32 per block over all layers."""
    src = make_cache(3, 12, block_dim=block_dim, dtype=torch.bfloat16)
    dst = make_cache(3, 12, block_dim=block_dim, dtype=torch.bfloat16, seed=4)
    exported = export_blocks(src, [11, 2, 7], block_dim=block_dim)
    assert exported.blocks == 3
    assert all(t.is_contiguous() and t.shape[0] == 3 for t in exported.data)
    import zlib

    block2 = b"".join(bytes(src[layer].select(block_dim, 2).contiguous().view(torch.uint8)
                            .numpy()) for layer in range(3))
    assert exported.checksums[1] == zlib.crc32(block2)
    want = expected_copy(src, dst, [11, 2, 7], [0, 5, 6], block_dim)
    import_blocks(dst, [0, 5, 6], exported).wait()
    assert bits_equal(dst, want)


def test_import_refuses_a_corrupted_block_and_writes_nothing(default_kernel: Any) -> None:
    """One flipped byte fails its block's checksum; the destination stays untouched."""
    src, dst = make_cache(2, 6), make_cache(2, 6, seed=8)
    exported = export_blocks(src, [0, 1, 2])
    exported.data[1][2].view(torch.uint8).view(-1)[5] ^= 0x10
    before = [d.clone() for d in dst]
    with pytest.raises(KVChecksumError, match="exported block 2: checksum mismatch"):
        import_blocks(dst, [3, 4, 5], exported)
    assert bits_equal(dst, before)


def test_checksums_differ_for_different_blocks() -> None:
    """Checksums identify content: equal blocks match, a changed byte changes the sum."""
    data = torch.zeros(3, 64, dtype=torch.uint8)
    data[2, 63] = 1
    sums = block_checksums([data])
    assert sums[0] == sums[1] != sums[2]


# ----------------------------------------------------- fake streams, lazy like a GPU


FLUSHING: list[str] = []  # streams being run right now (waits inside them are not host waits)


@dataclass
class FakeEvent:
    """Completes only when its stream has run up to the point it was recorded at."""

    stream: FakeStream
    position: int

    def synchronize(self) -> None:
        if not FLUSHING:
            self.stream.log.append(f"host-wait {self.stream.name}")
        self.stream.flush(self.position)

    def query(self) -> bool:
        return self.stream.done >= self.position


@dataclass
class FakeStream:
    """Queues work and runs it as late as possible, like an asynchronous device queue."""

    name: str
    log: list[str]
    queue: list[Callable[[], None]] = field(default_factory=list)
    done: int = 0

    def flush(self, position: int) -> None:
        FLUSHING.append(self.name)
        try:
            while self.done < position:
                work = self.queue[self.done]
                self.done += 1
                work()
        finally:
            FLUSHING.pop()


class LazyOps:
    """StreamOps that defer every queued operation until an event forces it.

    A pipeline that reads a buffer without waiting for the event of the work
    that fills it sees stale bytes here, so bit-exact tests catch missing waits.
    """

    def __init__(self, *, drop_waits: bool = False) -> None:
        self.log: list[str] = []
        self.streams: list[FakeStream] = []
        self.pinned: list[bool] = []
        self.released: list[Any] = []
        self.drop_waits = drop_waits

    def new_stream(self, device: Any) -> FakeStream:
        stream = FakeStream(f"s{len(self.streams)}", self.log)
        self.streams.append(stream)
        return stream

    def join_current(self, stream: FakeStream, device: Any) -> None:
        self.log.append(f"join {stream.name}")

    def run(self, stream: FakeStream, work: Callable[[], None]) -> None:
        self.log.append(f"run {stream.name}")
        stream.queue.append(work)

    def transfer(self, stream: FakeStream, dst: Any, src: Any) -> None:
        self.log.append(f"transfer {stream.name}")

        def work() -> None:  # reads `src` when it runs, as a DMA engine would
            dst.copy_(src, non_blocking=True)

        stream.queue.append(work)

    def record(self, stream: FakeStream) -> FakeEvent:
        return FakeEvent(stream, len(stream.queue))

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(f"wait {stream.name}<-{event.stream.name}")
        if self.drop_waits:
            return
        stream.queue.append(event.synchronize)

    def staging(self, shape: tuple[int, ...], dtype: Any, device: Any, *, pinned: bool) -> Any:
        self.pinned.append(pinned)
        return torch.full(shape, 0, dtype=dtype, device=device)

    def mark_used(self, tensor: Any, stream: Any) -> None:
        return None

    def release(self, buffers: Any) -> None:
        self.released.extend(buffers)


def pieces_for(src: list[Any], dst: list[Any], sids: list[int], dids: list[int],
               chunk: int) -> list[Piece]:
    s_index, d_index = torch.tensor(sids), torch.tensor(dids)
    return [
        Piece(src=s.view(s.shape[0], -1), dst=d.view(d.shape[0], -1), src_ids=si, dst_ids=di)
        for s, d in zip(src, dst, strict=True)
        for si, di in zip(s_index.split(chunk), d_index.split(chunk), strict=True)
    ]


ROUTES = [("device", "host", True), ("host", "device", True), ("device", "device", True),
          ("device", "device", False)]


@pytest.mark.parametrize(("src_kind", "dst_kind", "crossing"), ROUTES)
@pytest.mark.parametrize("depth", [2, 3])
def test_lazy_streams_still_copy_exactly(
    src_kind: str, dst_kind: str, crossing: bool, depth: int,
) -> None:
    """D2H, H2D, peer D2D and same-GPU orderings hold when device work runs as late as possible."""
    src, dst = make_cache(2, 30, seed=11), make_cache(2, 30, seed=12)
    sids, dids = list(range(29, -1, -1))[:25], list(range(25))
    want = expected_copy(src, dst, sids, dids)
    ops = LazyOps()
    handle = run_pipeline(pieces_for(src, dst, sids, dids, chunk=3), src_kind=src_kind,
                          dst_kind=dst_kind, ops=ops, depth=depth, crossing=crossing)
    assert isinstance(handle, CopyHandle)
    if dst_kind == "device":
        assert not handle.done()  # queued, not run: the caller must wait
    handle.wait()
    assert handle.done()
    assert bits_equal(dst, want)


def test_same_device_run_is_queued_on_the_stream_unstaged() -> None:
    """On one device, a piece whose destination is a run is one queued kernel: nothing
    has landed before wait(), no staging is asked for, and the copy is exact after."""
    src, dst = make_cache(2, 30, seed=13), make_cache(2, 30, seed=14)
    sids, dids = [29, 3, 17, 8], [10, 11, 12, 13]
    want = expected_copy(src, dst, sids, dids)
    before = [d.clone() for d in dst]
    s_index, d_index = torch.tensor(sids), torch.tensor(dids)
    pieces = [Piece(src=s.view(30, -1), dst=d.view(30, -1), src_ids=s_index, dst_ids=d_index,
                    dst_start=10) for s, d in zip(src, dst, strict=True)]
    ops = LazyOps()
    handle = run_pipeline(pieces, src_kind="device", dst_kind="device", ops=ops, depth=2,
                          crossing=False)
    assert not handle.done()  # queued, not run
    assert bits_equal(dst, before)
    handle.wait()
    assert ops.pinned == []
    assert ops.log[:1] == ["join s0"]
    assert bits_equal(dst, want)


def test_missing_waits_would_be_caught_by_the_fake() -> None:
    """The lazy fake is strict enough: dropping the stream waits corrupts the copy."""
    src, dst = make_cache(1, 30, seed=11), make_cache(1, 30, seed=12)
    sids, dids = list(range(30)), list(range(29, -1, -1))
    want = expected_copy(src, dst, sids, dids)
    run_pipeline(pieces_for(src, dst, sids, dids, chunk=2), src_kind="device", dst_kind="device",
                 ops=LazyOps(drop_waits=True), depth=2, crossing=True).wait()
    assert not bits_equal(dst, want)


def test_host_staging_is_pinned_only_across_the_bus() -> None:
    """Pinned staging is requested for the host side of a host/device copy, never otherwise."""
    src, dst = make_cache(1, 8), make_cache(1, 8, seed=1)
    for (sk, dk), pinned in {("host", "device"): [True, True, False, False],
                             ("device", "host"): [False, False, True, True],
                             ("device", "device"): [False, False, False, False]}.items():
        ops = LazyOps()
        run_pipeline(pieces_for(src, dst, [0, 1], [2, 3], chunk=1), src_kind=sk, dst_kind=dk,
                     ops=ops, depth=2, crossing=True).wait()
        assert ops.pinned == pinned, (sk, dk)


def test_device_to_host_overlaps_next_gather_with_current_copy() -> None:
    """D2H queues piece k+1's gather and copy before the host waits on piece k's copy."""
    src, dst = make_cache(1, 8), make_cache(1, 8, seed=1)
    ops = LazyOps()
    run_pipeline(pieces_for(src, dst, [0, 1, 2, 3], [3, 2, 1, 0], chunk=1),
                 src_kind="device", dst_kind="host", ops=ops, depth=2)
    queued_at_wait = []
    transfers = 0
    for line in ops.log:
        transfers += line.startswith("transfer")
        if line.startswith("host-wait"):
            queued_at_wait.append(transfers)
    # The host blocks only to scatter piece k, and only once copy k+1 is queued
    # behind it (slot reuse on the device side is a stream wait, not a host wait).
    assert queued_at_wait == [2, 3, 4, 4]
    assert {line.split()[1] for line in ops.log if line.startswith("transfer")} == {"s1"}
    assert ops.log[:2] == ["join s0", "join s1"]  # both streams wait for the caller first


def test_cuda_copies_on_streams() -> None:
    """On a CUDA device, D2D, D2H and H2D copies are bit-exact (skips without a GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA paths are covered by the lazy fake streams above")
    dev = torch.device("cuda")
    host = make_cache(2, 64, seed=21)
    gpu = [t.to(dev) for t in make_cache(2, 64, seed=22)]
    sids, dids = list(range(0, 64, 2)), list(range(63, 0, -2))
    want = expected_copy(host, [t.cpu() for t in gpu], sids, dids)
    copy_blocks(host, gpu, sids, dids, chunk_bytes=4096).wait()
    assert bits_equal([t.cpu() for t in gpu], want)
    back = make_cache(2, 64, seed=23)
    want_back = expected_copy([t.cpu() for t in gpu], back, dids, sids)
    copy_blocks(gpu, back, dids, sids, chunk_bytes=4096).wait()
    assert bits_equal(back, want_back)
    other = [torch.zeros_like(t) for t in gpu]
    copy_blocks(gpu, other, sids, sids).wait()
    assert all(torch.equal(o[sids], g[sids]) for o, g in zip(other, gpu, strict=True))


def test_host_staging_is_recycled_between_copies() -> None:
    """CPU copies hand their staging slots back to the pool, and the next copy reuses them."""
    from dynamo_ftctl.kv.copy import STAGING_POOL

    src, dst = make_cache(1, 40, seed=31), make_cache(1, 40, seed=32)
    row_bytes = src[0][0].numel() * src[0].element_size()
    first = copy_blocks(src, dst, [7, 3, 5, 1, 0, 2, 4, 6], list(range(15, 7, -1)),
                        chunk_bytes=4 * row_bytes, native=False)  # random ids: staged
    assert first.pieces == 2
    assert first.release is None  # released already: host work is done on return
    rows = src[0].view(40, -1).view(torch.complex128).shape[1]
    taken = STAGING_POOL.take((4, rows), torch.complex128, pinned=False)
    STAGING_POOL.give(taken)
    again = STAGING_POOL.take((4, rows), torch.complex128, pinned=False)
    assert again is taken  # the pooled buffer, not a fresh allocation
    STAGING_POOL.give(again)


def test_device_staging_is_released_only_after_wait() -> None:
    """Queued device work keeps its staging until wait(); then it goes back exactly once."""
    src, dst = make_cache(1, 8), make_cache(1, 8, seed=1)
    ops = LazyOps()
    handle = run_pipeline(pieces_for(src, dst, [0, 1, 2], [3, 4, 5], chunk=1),
                          src_kind="device", dst_kind="host", ops=ops, depth=2)
    handle_dev = run_pipeline(pieces_for(src, dst, [0, 1], [6, 7], chunk=1),
                              src_kind="host", dst_kind="device", ops=ops, depth=2)
    assert ops.released == []
    handle.wait()
    handle_dev.wait()
    handle_dev.wait()
    assert len(ops.released) == 8  # 2 source + 2 destination slots per copy, once each
