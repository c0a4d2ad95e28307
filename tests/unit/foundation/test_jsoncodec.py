"""`jsoncodec`: msgspec's speed, with json's reach for what msgspec refuses."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.jsoncodec import dumps, loads, loads_strict

_DOCS = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_DOCS)
def test_loads_reads_what_dumps_writes_as_json_would(doc: object) -> None:
    """Round trip: `loads(dumps(doc))` is what json reads back from json's own text."""
    assert loads(dumps(doc)) == json.loads(json.dumps(doc))


def test_what_msgspec_refuses_goes_to_json() -> None:
    """Lone surrogates, NaN and integers past 64 bits: read as json reads them."""
    assert loads(b'"\\ud800"') == "\ud800"
    assert loads("[NaN]")[0] != loads("[NaN]")[0]  # NaN, the one value unequal to itself
    assert loads(b"123456789012345678901234567890") == 123456789012345678901234567890
    assert dumps("\udcfc") == b'"\\udcfc"'


def test_bytes_that_are_not_utf8_read_with_replacement() -> None:
    """A bad byte in a string reads as U+FFFD, as the SSE decoder's text has it."""
    assert loads(b'{"a": "x\xff"}') == {"a": "x\ufffd"}


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", "1e999", "{", "[1,]"])
def test_strict_refuses_what_is_not_strict_json(text: str) -> None:
    """`loads_strict`: NaN, Infinity, numbers past a double and broken JSON are ValueErrors."""
    with pytest.raises(ValueError):  # noqa: PT011 (msgspec's and json's errors alike)
        loads_strict(text)


def test_strict_still_reads_lone_surrogates() -> None:
    """The engine answers lone-surrogate escapes, so a strict reader must take them."""
    assert loads_strict('{"t": "\\udcfc"}') == {"t": "\udcfc"}
