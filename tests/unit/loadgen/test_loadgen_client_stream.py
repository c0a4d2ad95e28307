"""The client's per-event fast path agrees with the shared `openai` extraction helpers."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_ftctl.loadgen.client import SERVER_TTFT_FIELD, _StreamState
from dynamo_ftctl.openai import (
    SseEvent,
    extract_finish_reason,
    extract_text,
    extract_usage,
    parse_error_body,
)

_values = st.one_of(st.none(), st.text(max_size=3), st.integers(-1, 2), st.booleans())
_parts = st.one_of(_values, st.fixed_dictionaries({}, optional={"content": _values,
                                                                "role": _values}))
_choice = st.one_of(_values, st.fixed_dictionaries({}, optional={
    "index": st.one_of(st.integers(0, 1), st.none()), "text": _values, "delta": _parts,
    "message": _parts, "finish_reason": st.one_of(st.none(), st.sampled_from(["", "length"]),
                                                  st.integers(0, 1))}))
_doc = st.fixed_dictionaries({}, optional={
    "choices": st.one_of(_values, st.lists(_choice, max_size=2)),
    "usage": st.one_of(_values, st.fixed_dictionaries(
        {"completion_tokens": st.integers(0, 5)})),
    "error": st.one_of(st.none(), st.text(max_size=2), st.just({"message": "boom"})),
    "object": st.sampled_from(["text_completion", "error"]),
    "message": st.just("m"),
    SERVER_TTFT_FIELD: st.one_of(st.none(), st.booleans(), st.floats(0, 100), st.text()),
})


def _reference(doc: dict[str, Any]) -> tuple[bool, bool, str | None, int | None, float | None,
                                             int]:
    """What the stream state must conclude from one event, by the general helpers."""
    api_error = parse_error_body(doc)
    if api_error is not None:
        return True, False, f"SSE error event: {api_error}", None, None, 0
    stamped = 1 if extract_text(doc) else 0
    finished = bool(extract_finish_reason(doc))
    server = doc.get(SERVER_TTFT_FIELD) if finished else None
    if isinstance(server, bool) or not isinstance(server, int | float):
        server = None
    usage = extract_usage(doc)
    tokens = usage.completion_tokens if usage is not None and usage.completion_tokens else None
    return (False, finished, None, tokens, None if server is None else server / 1000.0,
            stamped)


@settings(max_examples=500, deadline=None)
@given(doc=_doc)
def test_fast_path_equals_the_general_helpers(doc: dict[str, Any]) -> None:
    """For any chunk shape: same stamp, finish, usage, server TTFT and error as the helpers."""
    state = _StreamState()
    stamps: list[float] = []
    over = state.take(SseEvent(json.dumps(doc)), 1.5, stamps)
    assert (over, state.finished, state.error, state.usage_tokens, state.server_ttft,
            len(stamps)) == _reference(doc)


def test_a_stream_is_judged_by_its_events() -> None:
    """Tokens stamp, the finish chunk's server TTFT is kept, [DONE] ends it as ok."""
    state = _StreamState()
    stamps: list[float] = []
    chunks = [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}],
         SERVER_TTFT_FIELD: 12.5},
        {"choices": [], "usage": {"completion_tokens": 3}},
    ]
    for t, chunk in enumerate(chunks):
        assert not state.take(SseEvent(json.dumps(chunk)), float(t), stamps)
    assert state.take(SseEvent("[DONE]"), 9.0, stamps)
    assert stamps == [0.0, 2.0]
    assert state.verdict() == ("ok", None, 3, 0.0125)
