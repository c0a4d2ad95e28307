"""Byte tokenizer round trips, the KV wire format's checks, and fault parsing."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dynamo_ftctl.engine.errors import UnencodableText
from dynamo_ftctl.engine.faults import FaultState, parse_fault, parse_fault_flag, xid_crash_lines
from dynamo_ftctl.engine.tokenizer import (
    ASSISTANT,
    BOS,
    END,
    USER,
    ByteTokenizer,
    IncrementalDetokenizer,
)
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.gpu.kmsg import parse_xid_line
from dynamo_ftctl.kv.wire import KvHeader, KvLayout, decode_kv, encode_kv

TOK = ByteTokenizer()
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")


@given(st.text())
def test_text_round_trips(text: str) -> None:
    """decode(encode(text)) == text for any text."""
    assert TOK.decode(TOK.encode(text)) == text


@given(st.text(st.one_of(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
                         st.characters(categories=("Cs",)), st.characters(max_codepoint=127))))
def test_only_escaped_bytes_among_lone_surrogates_encode(text: str) -> None:
    """U+DC80-U+DCFF (undecodable bytes) encode to their bytes; any other lone surrogate
    is `UnencodableText` naming the first one, never a UnicodeEncodeError."""
    bad = [i for i, ch in enumerate(text)
           if "\ud800" <= ch <= "\udfff" and not "\udc80" <= ch <= "\udcff"]
    if not bad:
        assert TOK.decode(TOK.encode(text)) == text
        return
    with pytest.raises(UnencodableText) as caught:
        TOK.encode(text)
    assert caught.value.index == bad[0]
    with pytest.raises(UnencodableText):
        TOK.check_encodable(text)


@given(st.lists(st.integers(0, 261), max_size=64))
def test_ids_round_trip(ids: list[int]) -> None:
    """encode(decode(ids)) == ids, invalid UTF-8 and specials included."""
    assume(b"<|" not in bytes(i for i in ids if i < 256))
    assert TOK.encode(TOK.decode(ids)) == ids


@given(st.lists(st.integers(0, 261), max_size=64))
def test_incremental_detokenizer_matches_decode(ids: list[int]) -> None:
    """Streamed text deltas join to the same text as decoding all ids at once."""
    detok = IncrementalDetokenizer(TOK)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == TOK.decode(ids)


def test_chat_template_and_continuation() -> None:
    """A continued final message is the open prompt plus its text, no end marker."""
    messages = [{"role": "user", "content": "hi"}]
    assert TOK.apply_chat_template(messages) == [BOS, USER, 104, 105, END, ASSISTANT]
    cont = [*messages, {"role": "assistant", "content": "ok"}]
    ids = TOK.apply_chat_template(cont, add_generation_prompt=False, continue_final_message=True)
    assert ids == [BOS, USER, 104, 105, END, ASSISTANT, 111, 107]


def _payload(tokens: int = 6) -> tuple[KvHeader, list[bytes]]:
    header = KvHeader(layout=LAYOUT, model="m", request_id="r1", token_ids=tuple(range(tokens + 1)),
                      prompt_len=3, num_tokens=tokens, sampling={"seed": 1, "max_tokens": 9})
    blocks = [bytes([i]) * LAYOUT.block_bytes for i in range(header.num_blocks)]
    return header, blocks


def test_wire_round_trip_is_zero_copy() -> None:
    """Decoding gives back the header and the blocks as views into the input."""
    header, blocks = _payload()
    data = bytearray(encode_kv(header, blocks))
    decoded = decode_kv(data)
    assert decoded.header == header
    assert [bytes(b) for b in decoded.blocks] == blocks
    data[-1] ^= 0xFF  # the view sees the caller's buffer (no copy was made)
    assert decoded.blocks[-1][-1] == blocks[-1][-1] ^ 0xFF


def test_wire_names_the_corrupted_block() -> None:
    """A flipped byte in block 1 is rejected with that block's index."""
    header, blocks = _payload(tokens=7)
    data = bytearray(encode_kv(header, blocks))
    data[len(data) - LAYOUT.block_bytes - 5] ^= 0x01  # inside the first of two blocks' tail
    with pytest.raises(InvalidInput, match=r"block 0 of 2 is corrupted"):
        decode_kv(bytes(data))


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: b"XXXX" + d[4:], "not a KV export"),
    (lambda d: d[:-3], "truncated or padded"),
    (lambda d: d[:14] + bytes([d[14] ^ 1]) + d[15:], "header checksum mismatch"),
    (lambda d: d[:5], "too short"),
])
def test_wire_rejects_damage(mutate: object, message: str) -> None:
    """Bad magic, truncation, header damage and short input each get a clear error."""
    header, blocks = _payload()
    data = encode_kv(header, blocks)
    assert callable(mutate)
    with pytest.raises(InvalidInput, match=message):
        decode_kv(mutate(data))


def test_fault_parsing() -> None:
    """Bodies and flags parse; unknown kinds, fields and Xids are InvalidInput."""
    assert parse_fault({"kind": "slow", "delay_ms": 50}).delay_ms == 50
    assert parse_fault_flag("disconnect:after_tokens=20").after_tokens == 20
    assert parse_fault_flag("crash:xid=79,after_s=0.5").after_s == 0.5
    for bad in ({"kind": "melt"}, {"kind": "slow"}, {"kind": "crash", "xid": 99999},
                {"kind": "sdc", "colour": 1}, ["kind"]):
        with pytest.raises(InvalidInput):
            parse_fault(bad)
    state = FaultState()
    state.apply(parse_fault({"kind": "sdc"}))
    state.apply(parse_fault({"kind": "slow", "delay_ms": 10}))
    assert state.sdc
    assert state.delay_s == 0.01
    state.apply(parse_fault({"kind": "clear"}))
    assert (state.sdc, state.delay_s, state.disconnect_after) == (False, 0.0, None)


def test_crash_line_parses_as_a_kernel_xid() -> None:
    """The crash fault's stderr line is what ftctl's own kernel-log parser recognises."""
    line = xid_crash_lines(48, "0000:3b:00")[0]
    parsed = parse_xid_line(line)
    assert parsed is not None
    assert parsed.xid == 48
    assert "pid=" in line
