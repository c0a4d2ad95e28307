"""A directory of KV blocks shared by workers: chain-hash keys, atomic files, a byte budget.

A block's key is a chain hash of the token ids up to the end of that block
(`chain_keys`): block i's key hashes block i-1's key with block i's ids, so any
sequence that shares the first (i+1) × block_size ids with another has the same
first i+1 keys, whatever comes after, and no key names a block whose prefix
differs. A `namespace` (model, dtype, block size, KV shape) seeds the chain so
two models never share a key.

One file per key (`<root>/<2 hex>/<key>`, plus a suffix per shard): a header
(magic, the key, a geometry string, the payload's length and CRC-32, the
header's own CRC-32), then the payload. Files are written to a temporary name
in the same directory and renamed into place, so a reader sees a whole file or
none; a file that fails any check (magic, header CRC, key, geometry, length,
payload CRC) is a miss, never an error. Rename without fsync: the files
survive the death of a writer, not of the host (the cache is rebuilt by use).

The budget is kept by eviction, oldest modification time first (a load
refreshes it: least recently written or loaded goes first), down to
`LOW_WATER` of the budget. Several workers write one store; each counts its own
writes and rescans the directory when they pass `budget / RESCAN_PARTS` since
its last scan, so the store exceeds its budget by at most that much per writer.

This module is torch-free and knows nothing of engines.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_ftctl.errors import InvalidInput, WriteFailed
from dynamo_ftctl.safefiles import write_atomic

__all__ = ["HEADER", "LOAD_PARAM", "LOW_WATER", "MAGIC", "REPORT_PARAM", "RESCAN_PARTS",
           "BlockStore", "EvictionReport", "chain_keys", "namespace_key"]

# A request's `kv_transfer_params` (vLLM passes them to the connector) may hold these:
# LOAD_PARAM false makes the connector load nothing for it (its blocks are still saved):
# `ftctl proxy` asks that where its calibration says recompute is faster; REPORT_PARAM
# true makes a non-streamed answer's `kv_transfer_params` carry REPORT_PARAM's report
# (tokens loaded, the cache's geometry): what `ftctl migrate calibrate --via store` reads.
LOAD_PARAM = "ftctl_load"
REPORT_PARAM = "ftctl_report"
MAGIC = b"FTCTLKV1"
# magic, key length, geometry length, payload length, payload CRC-32, header CRC-32
HEADER = struct.Struct("<8sHHQII")
KEY_BYTES = 16  # 128-bit keys: a collision needs ~2^64 blocks
LOW_WATER = 0.9  # eviction frees down to this share of the budget (hysteresis)
RESCAN_PARTS = 8  # a writer rescans after writing budget / RESCAN_PARTS bytes
STALE_TEMP_S = 60.0  # a temporary file this old belongs to a writer that died
_READ_CHUNK = 1 << 20


def namespace_key(*parts: object) -> bytes:
    """The seed of a chain: a digest of what makes two caches' blocks interchangeable."""
    text = "\x1f".join(map(str, parts)).encode()
    return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()


def chain_keys(namespace: bytes, token_ids: Sequence[int], block_size: int,
               *, start: int = 0, previous: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks of `token_ids` from block `start` on (a partial last block
    has none). `previous` is block start-1's key (the namespace when start is 0)."""
    if block_size <= 0:
        msg = f"block size must be > 0 (got {block_size})"
        raise InvalidInput(msg)
    if start > 0 and previous is None:
        msg = "chain_keys from a later block needs the previous block's key"
        raise InvalidInput(msg)
    prev = namespace if start == 0 else previous
    assert prev is not None
    keys = []
    for block in range(start, len(token_ids) // block_size):
        ids = token_ids[block * block_size:(block + 1) * block_size]
        try:
            packed = struct.pack(f"<{block_size}q", *ids)
        except struct.error:
            msg = "token ids must be integers in int64's range"
            raise InvalidInput(msg) from None
        prev = hashlib.blake2b(prev + packed, digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class EvictionReport:
    """One scan of the store: what it held, what was removed, what is left."""

    files: int
    bytes_before: int
    evicted_files: int
    evicted_bytes: int
    stale_temps: int

    @property
    def bytes_after(self) -> int:
        """Bytes of block files left after the scan."""
        return self.bytes_before - self.evicted_bytes


class BlockStore:
    """KV blocks as files under `root`, at most about `budget_bytes` of them.

    `write` and `read_into` never raise for a missing, partial or damaged file
    (a miss: False); an unwritable store raises `OSError` from `write` for the
    caller to count. `suffix` tells shards of one block apart (a TP rank).
    """

    def __init__(self, root: Path | str, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            msg = f"budget_bytes must be > 0 (got {budget_bytes})"
            raise InvalidInput(msg)
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._written_since_scan = 0
        # key file -> (inode, size, mtime) of the copy last verified whole (`verify`)
        self._verified: dict[str, tuple[int, int, int]] = {}

    # ------------------------------------------------------------------ naming

    def path_for(self, key: bytes, suffix: str = "") -> Path:
        """The file of block `key` (shard `suffix`)."""
        name = key.hex() + suffix
        return self.root / name[:2] / name

    def has(self, key: bytes, suffix: str = "") -> bool:
        """Whether a file exists for `key` (not whether it is sound: `verify`)."""
        return self.path_for(key, suffix).exists()

    # ------------------------------------------------------------------ writing

    def write(self, key: bytes, geometry: bytes, parts: Sequence[Any], *,
              crc: int | None = None, suffix: str = "") -> int:
        """Write block `key` from the byte buffers `parts` (their concatenation is the
        payload; `crc` its CRC-32 when the caller has it). Returns the bytes written,
        0 when the block was there already. Atomic: temporary file, then rename
        (`safefiles.write_atomic`, without fsync); a refused write is `WriteFailed`."""
        path = self.path_for(key, suffix)
        if path.exists():
            return 0
        views = [memoryview(p).cast("B") for p in parts]
        payload_len = sum(v.nbytes for v in views)
        if crc is None:
            crc = 0
            for view in views:
                crc = zlib.crc32(view, crc)
        key_text = path.name.encode()
        head = HEADER.pack(MAGIC, len(key_text), len(geometry), payload_len, crc, 0)
        header_crc = zlib.crc32(head[:-4] + key_text + geometry)
        head = head[:-4] + struct.pack("<I", header_crc)
        try:
            path.parent.mkdir(exist_ok=True)
        except OSError as exc:
            raise WriteFailed(path, f"cannot write: {exc.strerror or exc}") from None
        write_atomic(path, [head, key_text, geometry, *views], follow_link=False, sync=False)
        size = len(head) + len(key_text) + len(geometry) + payload_len
        self._written_since_scan += size
        if self._written_since_scan >= self.budget_bytes // RESCAN_PARTS:
            self.evict()
        return size

    # ------------------------------------------------------------------ reading

    def verify(self, key: bytes, geometry: bytes | None = None, payload_len: int | None = None,
               *, suffix: str = "") -> bool:
        """Whether block `key`'s file is whole: header, key, lengths and payload CRC (and
        `geometry` when given). A file verified before and unchanged since (same inode,
        size and mtime) is not read again."""
        path = self.path_for(key, suffix)
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
                if self._verified.get(path.name) == stamp and geometry is None:
                    return True
                found = _read_header(f, path.name, geometry, payload_len, st.st_size)
                if found is None:
                    return False
                want_crc, length = found
                crc = 0
                while length:
                    chunk = f.read(min(_READ_CHUNK, length))
                    if not chunk:
                        return False
                    crc = zlib.crc32(chunk, crc)
                    length -= len(chunk)
        except OSError:
            return False
        if crc != want_crc:
            return False
        if len(self._verified) > 65536:  # a memo, not an index: start afresh
            self._verified.clear()
        self._verified[path.name] = stamp
        return True

    def read_into(self, key: bytes, geometry: bytes, regions: Sequence[Any], *,
                  suffix: str = "", touch: bool = True) -> bool:
        """Fill the writable buffers `regions` (in order) with block `key`'s payload.
        False, with the regions' contents undefined, when the file is missing or fails
        a check (geometry, lengths, CRC). `touch` refreshes its age for eviction."""
        path = self.path_for(key, suffix)
        views = [memoryview(r).cast("B") for r in regions]
        try:
            with path.open("rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                found = _read_header(f, path.name, geometry, sum(v.nbytes for v in views), size)
                if found is None:
                    return False
                want_crc, _ = found
                crc = 0
                for view in views:
                    done = 0
                    while done < view.nbytes:
                        got = f.readinto(view[done:])
                        if not got:
                            return False
                        done += got
                    crc = zlib.crc32(view, crc)
            if crc != want_crc:
                return False
            if touch:
                with contextlib.suppress(OSError):
                    os.utime(path)
        except OSError:
            return False
        return True

    def discard(self, key: bytes, suffix: str = "") -> None:
        """Remove block `key`'s file (one found damaged), if it is still there."""
        with contextlib.suppress(OSError):
            self.path_for(key, suffix).unlink()
        self._verified.pop(key.hex() + suffix, None)

    # ------------------------------------------------------------------ budget

    def _entries(self) -> Iterator[os.DirEntry[str]]:
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as top:
            for sub in top:
                if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                    continue
                with contextlib.suppress(FileNotFoundError), os.scandir(sub.path) as files:
                    yield from files

    def evict(self, *, now: float | None = None) -> EvictionReport:
        """Scan the store; if it holds more than the budget, remove the oldest block files
        until it holds `LOW_WATER` of it. Temporary files older than `STALE_TEMP_S` (a
        writer that died mid-write) go too."""
        now = time.time() if now is None else now
        blocks: list[tuple[int, int, str]] = []
        stale = 0
        for entry in self._entries():
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TEMP_S:
                    with contextlib.suppress(FileNotFoundError):
                        Path(entry.path).unlink()
                        stale += 1
                continue
            blocks.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in blocks)
        evicted_files = evicted_bytes = 0
        if total > self.budget_bytes:
            target = int(self.budget_bytes * LOW_WATER)
            blocks.sort()
            for _, size, path in blocks:
                if total - evicted_bytes <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    Path(path).unlink()
                evicted_files += 1
                evicted_bytes += size
                self._verified.pop(Path(path).name, None)
        self._written_since_scan = 0
        return EvictionReport(files=len(blocks), bytes_before=total,
                              evicted_files=evicted_files, evicted_bytes=evicted_bytes,
                              stale_temps=stale)


def _read_header(f: Any, name: str, geometry: bytes | None, payload_len: int | None,
                 file_size: int) -> tuple[int, int] | None:
    """(payload CRC, payload length) from an open block file positioned at its start, the
    file left at its payload; None when anything disagrees."""
    raw = f.read(HEADER.size)
    if len(raw) != HEADER.size:
        return None
    magic, key_len, geo_len, length, crc, header_crc = HEADER.unpack(raw)
    if magic != MAGIC:
        return None
    rest = f.read(key_len + geo_len)
    if len(rest) != key_len + geo_len or zlib.crc32(raw[:-4] + rest) != header_crc:
        return None
    if rest[:key_len] != name.encode():
        return None
    if geometry is not None and rest[key_len:] != geometry:
        return None
    if payload_len is not None and length != payload_len:
        return None
    if file_size != HEADER.size + key_len + geo_len + length:
        return None
    return crc, length
