"""The proxy's SSE framing of client chunks, over the one JSON codec (`jsoncodec`:
msgspec, with json for what msgspec refuses), whose `dumps` and `loads` it re-exports.
"""

from __future__ import annotations

from typing import Any

from dynamo_ftctl.jsoncodec import dumps, loads

__all__ = ["SSE_DONE", "ClientPiece", "dumps", "loads", "sse_batch", "sse_event"]

SSE_DONE = b"data: [DONE]\n\n"

# What a batch for the client holds: a chunk the proxy encodes, or an upstream SSE
# block relayed byte for byte (a vendor `event:`, a comment), blank line included.
ClientPiece = dict[str, Any] | bytes


def sse_event(doc: Any) -> bytes:
    """`doc` as one SSE data event (bytes: a relayed block, written as it is)."""
    if type(doc) is bytes:
        return doc
    return b"data: " + dumps(doc) + b"\n\n"


def sse_batch(batch: list[ClientPiece]) -> bytes:
    """One write's worth of client chunks as SSE events."""
    return b"".join(map(sse_event, batch))
