"""The proxy's JSON and SSE codec: msgspec, with json for what msgspec refuses.

msgspec is ~10x json's speed on a token chunk (1 vs 14 us to encode, 2.5 vs 11 us
to decode), paid twice per token on the proxy's one core.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

__all__ = ["SSE_DONE", "ClientPiece", "dumps", "loads", "sse_batch", "sse_event"]

SSE_DONE = b"data: [DONE]\n\n"

# What a batch for the client holds: a chunk the proxy encodes, or an upstream SSE
# block relayed byte for byte (a vendor `event:`, a comment), blank line included.
ClientPiece = dict[str, Any] | bytes

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def dumps(doc: Any) -> bytes:
    """`doc` as compact JSON."""
    try:
        return _ENCODER.encode(doc)
    except UnicodeEncodeError:
        # Byte-level engines put undecodable bytes in text as lone surrogates
        # (\udcfc), which only an ASCII-escaped JSON string can carry back.
        return json.dumps(doc, separators=(",", ":")).encode()


def loads(data: str | bytes) -> Any:
    """A JSON document (ValueError for anything else)."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        # Lone-surrogate escapes, which msgspec refuses; bytes that are not UTF-8 read
        # as the SSE decoder's text would have them (U+FFFD for each bad sequence).
        return json.loads(data.decode("utf-8", "replace") if isinstance(data, bytes) else data)


def sse_event(doc: Any) -> bytes:
    """`doc` as one SSE data event (bytes: a relayed block, written as it is)."""
    if type(doc) is bytes:
        return doc
    return b"data: " + dumps(doc) + b"\n\n"


def sse_batch(batch: list[ClientPiece]) -> bytes:
    """One write's worth of client chunks as SSE events."""
    return b"".join(map(sse_event, batch))
