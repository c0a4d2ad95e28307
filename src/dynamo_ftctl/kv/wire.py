"""The KV export/import wire format: one self-describing binary blob per request.

Layout (all integers little-endian):

    offset 0       4 bytes   magic b"FTKV"
    offset 4       u16       format version (1)
    offset 6       u16       flags (0)
    offset 8       u32       H = length of the header
    offset 12      H bytes   header, UTF-8 JSON (below), padded with spaces so that
                             the blocks start at a multiple of 64 bytes
    offset 12+H    u32       CRC-32 of the header bytes
    offset 16+H    blocks    N blocks of `layout.block_bytes` each, back to back

The header holds the layout (`num_layers`, `num_kv_heads`, `head_dim`,
`block_size`, `dtype`, and `order`, the memory order inside one block:
"layer,kv,token,head,dim" with kv 0 = K, 1 = V), the model id, `token_ids`
(prompt + generated so far), `prompt_len`, `num_tokens` (tokens whose K/V are
in the blocks; N = ceil(num_tokens / block_size), the last block padded), the
`sampling` state needed to continue (seed, temperature, top_p, top_k,
max_tokens, ...), the `request_id`, the checksum algorithm (`crc32` or
`blake2b`, a 16-byte digest) and one checksum (hex) per block.

`encode_kv_into` lets a copier write the blocks straight into the export
buffer (`kv/payload.py` gathers them from a paged cache through `kv/copy.py`).
`decode_kv` checks everything and returns zero-copy `memoryview`s of the
blocks; any damage is an `InvalidInput` naming what is wrong (a corrupted
block by its index). Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.jsoncodec import loads

__all__ = [
    "DTYPE_BYTES",
    "MAGIC",
    "VERSION",
    "KvHeader",
    "KvLayout",
    "KvPayload",
    "block_checksum",
    "decode_kv",
    "encode_kv",
    "encode_kv_into",
]

MAGIC = b"FTKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHI")
_CRC = struct.Struct("<I")
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
ChecksumAlgo = Literal["crc32", "blake2b"]
_BLOCK_ALIGN = 64  # offset of the first block in an export, a multiple of this
_CHECKSUM_HEX = {"crc32": 8, "blake2b": 32}  # hex digits of one block's checksum


def block_checksum(data: bytes | memoryview, algo: ChecksumAlgo = "crc32") -> str:
    """The hex checksum of one block."""
    if algo == "crc32":
        return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class KvLayout:
    """Shape of one block: layers × (K, V) × block_size tokens × kv heads × head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    order: str = "layer,kv,token,head,dim"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        return self.block_bytes // self.block_size


@dataclass(frozen=True)
class KvHeader:
    """Everything about an exported request except the block bytes."""

    layout: KvLayout
    model: str
    request_id: str
    token_ids: tuple[int, ...]
    prompt_len: int
    num_tokens: int
    sampling: Mapping[str, Any] = field(default_factory=dict)
    checksum: ChecksumAlgo = "crc32"

    @property
    def num_blocks(self) -> int:
        """Blocks that carry the `num_tokens` cached tokens."""
        return -(-self.num_tokens // self.layout.block_size)


@dataclass(frozen=True)
class KvPayload:
    """A decoded export: the header and zero-copy views of the blocks."""

    header: KvHeader
    blocks: tuple[memoryview, ...]
    data: memoryview  # all blocks, contiguous


def encode_kv(header: KvHeader, blocks: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """Serialize a request's KV blocks with per-block checksums."""
    if len(blocks) != header.num_blocks:
        msg = f"{len(blocks)} blocks given, header needs {header.num_blocks}"
        raise ValueError(msg)
    _check_tokens(header)
    size = header.layout.block_bytes
    views = [memoryview(b).cast("B") for b in blocks]
    for index, view in enumerate(views):
        if view.nbytes != size:
            msg = f"block {index} has {view.nbytes} bytes, layout says {size}"
            raise ValueError(msg)
    head = _header_bytes(header, [block_checksum(v, header.checksum) for v in views])
    parts: list[bytes | memoryview] = [
        _PREFIX.pack(MAGIC, VERSION, 0, len(head)), head, _CRC.pack(zlib.crc32(head)), *views,
    ]
    return b"".join(parts)


def encode_kv_into(header: KvHeader, fill: Callable[[memoryview], None]) -> memoryview:
    """Serialize a request's KV with the block bytes written in place by `fill`.

    `fill` gets the writable region of all `header.num_blocks` blocks, back to
    back in the layout's order; the checksums are computed afterwards over what
    it wrote. The blocks are never copied again: the export is one buffer.
    """
    _check_tokens(header)
    width = _CHECKSUM_HEX[header.checksum]
    # A checksum's hex has a fixed width, so the header's length is known before them.
    head_len = len(_header_bytes(header, ["0" * width] * header.num_blocks))
    start = _PREFIX.size + head_len + _CRC.size
    size = header.layout.block_bytes
    buffer = bytearray(start + header.num_blocks * size)
    view = memoryview(buffer)
    fill(view[start:])
    sums = [block_checksum(view[start + i * size : start + (i + 1) * size], header.checksum)
            for i in range(header.num_blocks)]
    head = _header_bytes(header, sums)
    if len(head) != head_len:  # pragma: no cover (the widths above are exact)
        msg = "KV header length changed once the checksums were known"
        raise ValueError(msg)
    _PREFIX.pack_into(view, 0, MAGIC, VERSION, 0, head_len)
    view[_PREFIX.size : _PREFIX.size + head_len] = head
    _CRC.pack_into(view, _PREFIX.size + head_len, zlib.crc32(head))
    return view


def _check_tokens(header: KvHeader) -> None:
    if header.num_tokens > len(header.token_ids):
        msg = "num_tokens exceeds the token ids"
        raise ValueError(msg)


def _header_bytes(header: KvHeader, sums: Sequence[str]) -> bytes:
    doc = {
        "format": "ftctl-kv", "version": VERSION, "model": header.model,
        "request_id": header.request_id,
        "layout": {
            "num_layers": header.layout.num_layers, "num_kv_heads": header.layout.num_kv_heads,
            "head_dim": header.layout.head_dim, "block_size": header.layout.block_size,
            "dtype": header.layout.dtype, "order": header.layout.order,
        },
        "token_ids": list(header.token_ids), "prompt_len": header.prompt_len,
        "num_tokens": header.num_tokens, "sampling": dict(header.sampling),
        "checksum": header.checksum,
        "block_checksums": list(sums),
    }
    head = json.dumps(doc, separators=(",", ":")).encode()
    # Trailing JSON whitespace puts the blocks on a 64-byte boundary of the export,
    # so views of them are aligned for any element type.
    return head + b" " * (-(_PREFIX.size + len(head) + _CRC.size) % _BLOCK_ALIGN)


def _bad(message: str) -> InvalidInput:
    return InvalidInput(f"KV import: {message}")


def _int(doc: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"header field {key!r} must be an integer >= {minimum}, got {value!r}"
        raise _bad(msg)
    return value


def decode_kv(data: bytes | bytearray | memoryview) -> KvPayload:
    """Parse and verify an export; `InvalidInput` names the damage (block index, field)."""
    view = memoryview(data).cast("B")
    if view.nbytes < _PREFIX.size + _CRC.size:
        msg = f"{view.nbytes} bytes is too short for a KV export"
        raise _bad(msg)
    magic, version, _flags, head_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        msg = f"not a KV export (magic {bytes(magic)!r}, expected {MAGIC!r})"
        raise _bad(msg)
    if version != VERSION:
        msg = f"format version {version} is not supported (this build reads {VERSION})"
        raise _bad(msg)
    head_end = _PREFIX.size + head_len
    if head_end + _CRC.size > view.nbytes:
        msg = "truncated header"
        raise _bad(msg)
    head = view[_PREFIX.size : head_end]
    (crc,) = _CRC.unpack_from(view, head_end)
    if zlib.crc32(head) != crc:
        msg = "header checksum mismatch (header corrupted)"
        raise _bad(msg)
    try:
        doc = loads(bytes(head))
    except ValueError:
        msg = "header is not valid JSON"
        raise _bad(msg) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layout"), dict):
        msg = "header lacks a layout"
        raise _bad(msg)
    lay = doc["layout"]
    dtype = lay.get("dtype")
    if dtype not in DTYPE_BYTES:
        msg = f"unsupported dtype {dtype!r}"
        raise _bad(msg)
    layout = KvLayout(
        num_layers=_int(lay, "num_layers", 1), num_kv_heads=_int(lay, "num_kv_heads", 1),
        head_dim=_int(lay, "head_dim", 1), block_size=_int(lay, "block_size", 1), dtype=dtype,
        order=str(lay.get("order", "layer,kv,token,head,dim")),
    )
    token_ids = doc.get("token_ids")
    if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
        msg = "header field 'token_ids' must be a list of integers"
        raise _bad(msg)
    algo = doc.get("checksum")
    if algo not in ("crc32", "blake2b"):
        msg = f"unknown checksum algorithm {algo!r}"
        raise _bad(msg)
    sampling = doc.get("sampling")
    header = KvHeader(
        layout=layout, model=str(doc.get("model", "")), request_id=str(doc.get("request_id", "")),
        token_ids=tuple(token_ids), prompt_len=_int(doc, "prompt_len"),
        num_tokens=_int(doc, "num_tokens"),
        sampling=sampling if isinstance(sampling, dict) else {},
        checksum=algo,
    )
    if header.num_tokens > len(header.token_ids) or header.prompt_len > len(header.token_ids):
        msg = "num_tokens/prompt_len exceed the token ids"
        raise _bad(msg)
    sums = doc.get("block_checksums")
    if not isinstance(sums, list) or len(sums) != header.num_blocks:
        msg = f"expected {header.num_blocks} block checksums"
        raise _bad(msg)
    start = head_end + _CRC.size
    size = layout.block_bytes
    expected = start + header.num_blocks * size
    if view.nbytes != expected:
        msg = (f"{view.nbytes - start} bytes of blocks, expected {header.num_blocks} × {size} "
               f"(truncated or padded)")
        raise _bad(msg)
    blocks = []
    for index in range(header.num_blocks):
        block = view[start + index * size : start + (index + 1) * size]
        if block_checksum(block, algo) != sums[index]:
            msg = (f"block {index} of {header.num_blocks} is corrupted "
                   f"({algo} mismatch: expected {sums[index]}, got {block_checksum(block, algo)})")
            raise _bad(msg)
        blocks.append(block)
    return KvPayload(header, tuple(blocks), view[start:expected])
