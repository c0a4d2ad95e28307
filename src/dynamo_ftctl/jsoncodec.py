"""The one JSON codec: msgspec, with the standard library for what msgspec refuses.

msgspec is several times json's speed on a token chunk (docs/benchmarks.md), paid per
token by the proxy and the load generator. It refuses a few
documents json reads: lone-surrogate escapes ("\\ud800", which byte-level engines
send), NaN and Infinity, integers past 64 bits; those go to `json`. Encoding falls
back the same way for text holding lone surrogates, which only an ASCII-escaped
JSON string can carry.

`loads` reads what json reads; `loads_strict` refuses NaN, Infinity and numbers
past a double's range (a client's request body must be strict JSON).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

__all__ = ["decode_fast", "dumps", "loads", "loads_strict"]

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()

decode_fast = _DECODER.decode
"""msgspec alone (`msgspec.DecodeError`, `UnicodeDecodeError` for what it refuses): for a
loop that runs once per token and inlines `loads`, falling back to it."""


def dumps(doc: Any) -> bytes:
    """`doc` as compact JSON (`json.dumps(separators=(",", ":"))`'s bytes)."""
    try:
        return _ENCODER.encode(doc)
    except UnicodeEncodeError:
        return json.dumps(doc, separators=(",", ":")).encode()


def _text(data: str | bytes) -> str:
    # Bytes that are not UTF-8 read as an SSE decoder's text would have them (U+FFFD
    # for each bad sequence).
    return data.decode("utf-8", "replace") if isinstance(data, bytes | bytearray) else data


def loads(data: str | bytes) -> Any:
    """A JSON document (`ValueError` for anything else)."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return json.loads(_text(data))


def _refuse_constant(name: str) -> Any:
    msg = f"{name} is not a JSON number"
    raise ValueError(msg)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        msg = f"number out of range: {text[:32]}"
        raise ValueError(msg)
    return value


def loads_strict(data: str | bytes) -> Any:
    """A strict JSON document: `ValueError` for NaN, Infinity, numbers past a double's
    range and anything that is not JSON. `RecursionError` for nesting too deep to parse."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
