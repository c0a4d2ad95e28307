"""Wire payloads gathered from and scattered into paged caches through the block copier."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dynamo_ftctl.errors import InvalidInput  # noqa: E402
from dynamo_ftctl.kv.payload import gather_payload, scatter_payload  # noqa: E402
from dynamo_ftctl.kv.wire import KvHeader, KvLayout, block_checksum, decode_kv  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 12, 4, 2, 8


def header(num_tokens: int, dtype: str = "float16") -> KvHeader:
    layout = KvLayout(LAYERS, HEADS, DIM, BLOCK_SIZE, dtype)
    return KvHeader(layout=layout, model="m", request_id="r",
                    token_ids=tuple(range(num_tokens + 1)), prompt_len=1,
                    num_tokens=num_tokens, sampling={"seed": 1, "max_tokens": 9})


def cache(layout: str, seed: int, dtype: Any = torch.float16) -> list[Any]:
    """A random cache in one of three layouts (see LAYOUTS for each one's block dim)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(dtype)

    if layout == "kv-split":  # the sim's pool: [k0, v0, k1, v1, ...], [blocks, bs, heads, dim]
        return [rand(BLOCKS, BLOCK_SIZE, HEADS, DIM) for _ in range(2 * LAYERS)]
    if layout == "vllm":  # per layer [blocks, 2, bs, heads, dim]
        return [rand(BLOCKS, 2, BLOCK_SIZE, HEADS, DIM) for _ in range(LAYERS)]
    # flash: per layer [2, blocks, bs, heads, dim], blocks on dim 1
    return [rand(2, BLOCKS, BLOCK_SIZE, HEADS, DIM) for _ in range(LAYERS)]


LAYOUTS = [("kv-split", 0), ("vllm", 0), ("flash", 1)]


def wire_block(tensors: list[Any], block: int, block_dim: int) -> bytes:
    """One block's bytes in the wire's order (layer, K/V, token, head, dim), built by hand."""
    parts = [t.select(block_dim, block).contiguous().view(torch.uint8).numpy().tobytes()
             for t in tensors]
    return b"".join(parts)


@pytest.mark.parametrize(("layout", "block_dim"), LAYOUTS)
def test_gather_writes_the_wire_order_with_checksums(layout: str, block_dim: int) -> None:
    """Exported blocks are the cache's blocks in wire order, each with a matching checksum."""
    src = cache(layout, 1)
    ids = [7, 2, 9]
    blob = gather_payload(header(10), src, ids, block_dim=block_dim)
    decoded = decode_kv(blob)  # verifies the header CRC and every block checksum
    assert [bytes(b) for b in decoded.blocks] == [wire_block(src, i, block_dim) for i in ids]
    assert (len(blob) - decoded.data.nbytes) % 64 == 0  # blocks start 64-byte aligned
    assert block_checksum(decoded.blocks[0]) == block_checksum(wire_block(src, 7, block_dim))


@pytest.mark.parametrize(("layout", "block_dim"), LAYOUTS)
def test_scatter_round_trips_into_other_blocks(layout: str, block_dim: int) -> None:
    """Gather from one cache and scatter into other block ids of another: bit-exact, and
    every block not named is untouched."""
    src, dst = cache(layout, 1), cache(layout, 2)
    before = [t.clone() for t in dst]
    blob = gather_payload(header(9), src, [4, 0, 11], block_dim=block_dim)
    scatter_payload(decode_kv(blob), dst, [5, 6, 1], block_dim=block_dim)
    for s, d, b in zip(src, dst, before, strict=True):
        for a, c in ((4, 5), (0, 6), (11, 1)):
            assert torch.equal(d.select(block_dim, c).view(torch.uint8),
                               s.select(block_dim, a).view(torch.uint8))
        untouched = [i for i in range(BLOCKS) if i not in (5, 6, 1)]
        assert torch.equal(d.index_select(block_dim, torch.tensor(untouched)),
                           b.index_select(block_dim, torch.tensor(untouched)))


def test_bfloat16_and_an_empty_export_round_trip() -> None:
    """bf16 blocks copy bit for bit, and a request with no cached tokens exports no blocks."""
    src = cache("kv-split", 3, torch.bfloat16)
    dst = cache("kv-split", 4, torch.bfloat16)
    blob = gather_payload(header(5, "bfloat16"), src, [3, 8], block_dim=0)
    scatter_payload(decode_kv(blob), dst, [0, 1])
    assert all(torch.equal(d[[0, 1]].view(torch.uint8), s[[3, 8]].view(torch.uint8))
               for s, d in zip(src, dst, strict=True))
    empty = decode_kv(gather_payload(header(0, "bfloat16"), src, []))
    assert empty.blocks == ()


def test_corrupted_export_is_refused_before_a_byte_is_written() -> None:
    """A flipped byte in a block fails decode's checksum; the destination stays as it was."""
    src, dst = cache("kv-split", 1), cache("kv-split", 2)
    before = [t.clone() for t in dst]
    blob = bytearray(gather_payload(header(12), src, [1, 2, 3]))
    blob[-5] ^= 0x10
    with pytest.raises(InvalidInput, match="block 2 of 3 is corrupted"):
        scatter_payload(decode_kv(bytes(blob)), dst, [4, 5, 6])
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


def test_mismatched_caches_are_refused() -> None:
    """A cache whose dtype or block bytes differ from the export's layout is InvalidInput."""
    src = cache("kv-split", 1)
    with pytest.raises(InvalidInput, match="the export float32"):
        gather_payload(header(4, "float32"), src, [0])
    with pytest.raises(InvalidInput, match="make 384-byte blocks, the export's layout says 768"):
        gather_payload(header(4), src[:LAYERS], [0])
    with pytest.raises(InvalidInput, match="2 block ids for the 1 blocks of 4 tokens"):
        gather_payload(header(4), src, [0, 1])
    blob = decode_kv(gather_payload(header(4), src, [0]))
    with pytest.raises(InvalidInput, match="block id 12 out of range"):
        scatter_payload(blob, cache("kv-split", 2), [12])


def test_an_unaligned_foreign_export_still_imports() -> None:
    """An export whose blocks sit at an odd address is read through an aligned copy."""
    src, dst = cache("kv-split", 5), cache("kv-split", 6)
    blob = bytes(gather_payload(header(8), src, [2, 3]))
    shifted = memoryview(bytearray(b"x" + blob))[1:]  # the same bytes, one byte off
    scatter_payload(decode_kv(shifted), dst, [7, 8])
    assert all(torch.equal(d[[7, 8]], s[[2, 3]]) for s, d in zip(src, dst, strict=True))


@pytest.mark.parametrize(("layout", "block_dim"), LAYOUTS)
def test_block_tables_take_the_copiers_short_host_path(
    layout: str, block_dim: int, monkeypatch: pytest.MonkeyPatch, row_kernel: Any,
) -> None:
    """A block table (a list of ints) reaches the copier as an int64 tensor, so export and
    import of host caches skip the copier's general checks (tens of microseconds a torch
    call from cold caches); the round trip is still exact."""
    from dynamo_ftctl.kv import copy as kv_copy
    from dynamo_ftctl.kv import native

    monkeypatch.setattr(native, "kernel", lambda: row_kernel)
    general: list[int] = []
    real = kv_copy._check_caches

    def counting(*args: Any, **kwargs: Any) -> None:
        general.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(kv_copy, "_check_caches", counting)
    src, dst = cache(layout, 3), cache(layout, 4)
    blob = gather_payload(header(10), src, [7, 2, 9], block_dim=block_dim)
    scatter_payload(decode_kv(blob), dst, [0, 11, 5], block_dim=block_dim)
    for s, d in zip(src, dst, strict=True):
        for a, b in ((7, 0), (2, 11), (9, 5)):
            assert torch.equal(s.select(block_dim, a), d.select(block_dim, b))
    assert general == []
