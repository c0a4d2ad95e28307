"""The shared KV block store: chain-hash keys, atomic files, checksums, the byte budget."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.errors import InvalidInput, WriteFailed
from dynamo_ftctl.kv.blockstore import (
    HEADER,
    LOW_WATER,
    BlockStore,
    chain_keys,
    namespace_key,
)

NS = namespace_key("model", "float32", 4)
GEO = b"f32:(2,4,8)"
BLOCK = bytes(range(64))


def store_with(tmp_path: Path, budget: int = 1 << 20) -> BlockStore:
    return BlockStore(tmp_path / "store", budget)


# ---------------------------------------------------------------- chain keys


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 50), max_size=40), b=st.lists(st.integers(0, 50), max_size=40),
       block=st.integers(1, 6))
def test_chain_keys_match_exactly_on_shared_full_block_prefixes(
        a: list[int], b: list[int], block: int) -> None:
    """Block i's keys of two sequences are equal iff their first (i+1)*block ids are equal."""
    ka, kb = chain_keys(NS, a, block), chain_keys(NS, b, block)
    assert len(ka) == len(a) // block
    for i in range(min(len(ka), len(kb))):
        same_prefix = a[:(i + 1) * block] == b[:(i + 1) * block]
        assert (ka[i] == kb[i]) == same_prefix


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 2**31), max_size=60), block=st.integers(1, 8),
       split=st.integers(0, 10))
def test_chain_keys_continue_from_a_later_block(ids: list[int], block: int, split: int) -> None:
    """Keys computed in two steps (from block `split` on, given the previous key) are the
    keys computed at once: the scheduler extends a request's chain as it grows."""
    whole = chain_keys(NS, ids, block)
    split = min(split, len(whole))
    head = chain_keys(NS, ids[:split * block], block)
    tail = chain_keys(NS, ids, block, start=split, previous=head[-1] if head else None)
    assert head + tail == whole


def test_chain_keys_differ_between_namespaces() -> None:
    """Another model (namespace) never shares a key, even for the same ids."""
    other = namespace_key("model", "float16", 4)
    assert chain_keys(NS, [1, 2, 3, 4], 4) != chain_keys(other, [1, 2, 3, 4], 4)


def test_chain_keys_refuse_bad_input() -> None:
    """A zero block size, a later start without the previous key, or ids beyond int64 are
    InvalidInput."""
    with pytest.raises(InvalidInput):
        chain_keys(NS, [1], 0)
    with pytest.raises(InvalidInput):
        chain_keys(NS, [1, 2], 1, start=1)
    with pytest.raises(InvalidInput):
        chain_keys(NS, [2**70], 1)


# ---------------------------------------------------------------- files


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    """A written block reads back byte for byte into regions of any split."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [1, 2, 3, 4], 4)[0]
    assert store.write(key, GEO, [BLOCK[:10], BLOCK[10:]]) > len(BLOCK)
    out = [bytearray(20), bytearray(44)]
    assert store.read_into(key, GEO, out)
    assert bytes(out[0] + out[1]) == BLOCK
    assert store.verify(key)
    assert store.verify(key, GEO, len(BLOCK))


def test_write_of_an_existing_block_writes_nothing(tmp_path: Path) -> None:
    """A block already in the store is not written again (0 bytes)."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [9] * 4, 4)[0]
    assert store.write(key, GEO, [BLOCK])
    assert store.write(key, GEO, [BLOCK]) == 0


def test_a_refused_write_is_write_failed_and_leaves_nothing(tmp_path: Path) -> None:
    """A store where a block's directory cannot be made (a file in its place) refuses the
    write with WriteFailed and leaves no block and no temporary file."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [5] * 4, 4)[0]
    store.path_for(key).parent.write_bytes(b"in the way")
    with pytest.raises(WriteFailed):
        store.write(key, GEO, [BLOCK])
    assert not store.has(key)
    assert [p.name for p in store.root.rglob("*")] == [store.path_for(key).parent.name]


def test_a_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    """Only whole files carry the block's name: a temporary file in the directory (a
    writer mid-write) is never read as the block."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [7] * 4, 4)[0]
    path = store.path_for(key)
    path.parent.mkdir(parents=True)
    (path.parent / f".{path.name}.1.abcd.tmp").write_bytes(b"FTCTLKV1 half")
    assert not store.read_into(key, GEO, [bytearray(len(BLOCK))])
    assert not store.verify(key)


@pytest.mark.parametrize("where", ["magic", "header", "key", "payload", "truncate", "extend"])
def test_a_damaged_block_is_a_miss(tmp_path: Path, where: str) -> None:
    """A flipped byte anywhere, a cut or an extended file fails the read and the verify."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [3] * 4, 4)[0]
    store.write(key, GEO, [BLOCK])
    path = store.path_for(key)
    raw = bytearray(path.read_bytes())
    offset = {"magic": 0, "header": 12, "key": HEADER.size + 3, "payload": len(raw) - 5}
    if where == "truncate":
        raw = raw[:-1]
    elif where == "extend":
        raw += b"\0"
    else:
        raw[offset[where]] ^= 0xFF
    path.write_bytes(raw)
    assert not store.read_into(key, GEO, [bytearray(len(BLOCK))])
    assert not store.verify(key)


def test_a_file_under_another_key_or_geometry_is_a_miss(tmp_path: Path) -> None:
    """A block file renamed to another key, or read with another geometry (shape) or
    size, is a miss."""
    store = store_with(tmp_path)
    k1, k2 = chain_keys(NS, [1] * 8, 4)
    store.write(k1, GEO, [BLOCK])
    store.path_for(k2).parent.mkdir(exist_ok=True)
    os.link(store.path_for(k1), store.path_for(k2))
    assert not store.read_into(k2, GEO, [bytearray(len(BLOCK))])
    assert not store.read_into(k1, b"f16:(2,4,8)", [bytearray(len(BLOCK))])
    assert not store.read_into(k1, GEO, [bytearray(len(BLOCK) - 1)])
    assert not store.verify(k1, payload_len=len(BLOCK) + 1)


def test_verify_sees_a_file_replaced_after_it_was_verified(tmp_path: Path) -> None:
    """The verify memo is keyed by inode, size and mtime: a damaged replacement fails."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [4] * 4, 4)[0]
    store.write(key, GEO, [BLOCK])
    assert store.verify(key)
    path = store.path_for(key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    tmp = path.with_name("x.tmp")
    tmp.write_bytes(raw)
    tmp.replace(path)
    assert not store.verify(key)


def test_shards_of_one_block_are_separate_files(tmp_path: Path) -> None:
    """Suffixes (TP ranks) name separate files of one key."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [2] * 4, 4)[0]
    store.write(key, GEO, [BLOCK], suffix=".r0")
    assert store.verify(key, suffix=".r0")
    assert not store.verify(key, suffix=".r1")


# ---------------------------------------------------------------- budget


def test_eviction_removes_the_oldest_down_to_the_low_water_mark(tmp_path: Path) -> None:
    """Over budget, the least recently written blocks go first, down to LOW_WATER."""
    store = store_with(tmp_path, budget=1 << 30)
    keys = chain_keys(NS, list(range(40)), 4)
    sizes = []
    for age, key in enumerate(keys):
        sizes.append(store.write(key, GEO, [BLOCK]))
        stamp = 1_000_000 + age
        os.utime(store.path_for(key), (stamp, stamp))
    store.budget_bytes = sum(sizes) // 2
    report = store.evict()
    assert report.bytes_before == sum(sizes)
    assert report.bytes_after <= store.budget_bytes * LOW_WATER
    gone = [k for k in keys if not store.has(k)]
    assert gone == keys[:report.evicted_files]
    assert len(gone) < len(keys)


def test_writes_keep_the_store_within_budget(tmp_path: Path) -> None:
    """Writing far more than the budget leaves the store within budget plus one rescan's
    worth of writes."""
    budget = 20 * 120
    store = store_with(tmp_path, budget=budget)
    for key in chain_keys(NS, list(range(400)), 2):
        store.write(key, GEO, [BLOCK])
    held = sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())
    assert held <= budget + budget // 8 + 200


def test_a_load_refreshes_a_block_against_eviction(tmp_path: Path) -> None:
    """A block read (touched) after others were written outlives them."""
    store = store_with(tmp_path, budget=1 << 30)
    keys = chain_keys(NS, list(range(12)), 4)
    for age, key in enumerate(keys):
        store.write(key, GEO, [BLOCK])
        os.utime(store.path_for(key), (1000 + age, 1000 + age))
    assert store.read_into(keys[0], GEO, [bytearray(len(BLOCK))])
    store.budget_bytes = 200
    store.evict()
    assert store.has(keys[0])


def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    """A temporary file left by a writer that died is removed by the next scan."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [8] * 4, 4)[0]
    store.write(key, GEO, [BLOCK])
    tmp = store.path_for(key).parent / ".dead.1.ab.tmp"
    tmp.write_bytes(b"x")
    os.utime(tmp, (1, 1))
    assert store.evict().stale_temps == 1
    assert not tmp.exists()
    assert store.has(key)


def test_discard_removes_a_block(tmp_path: Path) -> None:
    """discard removes a block's file; discarding a missing one is not an error."""
    store = store_with(tmp_path)
    key = chain_keys(NS, [6] * 4, 4)[0]
    store.write(key, GEO, [BLOCK])
    store.discard(key)
    store.discard(key)
    assert not store.has(key)


def test_a_zero_budget_is_refused(tmp_path: Path) -> None:
    """budget_bytes must be positive."""
    with pytest.raises(InvalidInput):
        BlockStore(tmp_path, 0)
