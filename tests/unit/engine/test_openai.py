"""The shared OpenAI wire helpers: SSE decoding, extraction, error bodies, request bodies."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_ftctl.openai import (
    ApiError,
    SseDecoder,
    SseEvent,
    StreamAccumulator,
    chat_request,
    completion_request,
    error_body,
    extract_finish_reason,
    extract_logprobs,
    extract_prompt_token_ids,
    extract_text,
    extract_token_ids,
    extract_top_logprob,
    extract_usage,
    format_sse,
    iter_sse_events,
    iter_sse_lines,
    parse_error_body,
    parse_sse_event,
)

COMPLETION_CHUNK = {
    "id": "cmpl-1", "object": "text_completion", "model": "m",
    "choices": [{
        "index": 0, "text": "He", "finish_reason": None, "token_ids": [72, 101],
        "prompt_token_ids": [1, 2, 3],
        "logprobs": {
            "tokens": ["H", "e"], "token_logprobs": [-0.5, None],
            "top_logprobs": [{"H": -0.5, "h": -1.5}, {"e": -0.1}],
        },
    }],
}
CHAT_RESPONSE = {
    "id": "chatcmpl-1", "object": "chat.completion", "prompt_token_ids": [9, 8],
    "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length",
        "token_ids": [72, 105],
        "logprobs": {"content": [
            {"token": "H", "logprob": -0.2, "top_logprobs": [{"token": "H", "logprob": -0.2},
                                                             {"token": "x", "logprob": -3.0}]},
            {"token": "i", "logprob": -0.3, "top_logprobs": []},
        ]},
    }],
    "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
}


def test_decoder_handles_any_chunking_and_line_endings() -> None:
    """Events come out the same whether bytes arrive whole or one at a time, LF/CRLF/CR."""
    stream = b'data: {"a":1}\r\n\r\n: comment\n\nevent: x\ndata: one\rdata: two\r\rdata: [DONE]\n\n'
    whole = list(iter_sse_events([stream]))
    bytewise = list(iter_sse_events([stream[i:i + 1] for i in range(len(stream))]))
    assert whole == bytewise
    assert [e.data for e in whole] == ['{"a":1}', "one\ntwo", "[DONE]"]
    assert whole[1].event == "x"
    assert whole[2].is_done


_SSE_PIECES = [b"data: ", b"data:", b"id: 7", b"event: e", b"x", b"{}", b"\n", b"\n\n", b"\r",
               b": c"]


@given(st.lists(st.sampled_from(_SSE_PIECES), max_size=40).map(b"".join),
       st.lists(st.integers(0, 200), max_size=6))
def test_decoder_events_do_not_depend_on_reads(stream: bytes, cuts: list[int]) -> None:
    """Whole one-line events (the decoder's fast path) and any other reads give the same
    events, ids and names as the stream fed one byte at a time."""
    points = sorted({min(c, len(stream)) for c in cuts})
    reads = [stream[i:j] for i, j in zip([0, *points], [*points, len(stream)], strict=True)]
    decoder, reference = SseDecoder(), SseDecoder()
    got = [event for read in reads for event in decoder.feed(read)]
    expected = [event for i in range(len(stream)) for event in reference.feed(stream[i:i + 1])]
    assert got == expected


def test_decoder_fast_path_keeps_the_last_id_and_a_pending_event_name() -> None:
    """A whole `data:` read carries the stream's last id; after an `event:` line it is named."""
    decoder = SseDecoder()
    assert decoder.feed(b"id: 7\ndata: a\n\n") == [SseEvent("a", None, "7")]
    assert decoder.feed(b"data: b\n\n") == [SseEvent("b", None, "7")]
    assert decoder.feed(b"event: e\n") == []
    assert decoder.feed(b"data: c\n\n") == [SseEvent("c", "e", "7")]
    assert decoder.feed(b"data: d\n\n") == [SseEvent("d", None, "7")]


def test_decoder_flushes_a_final_event_without_blank_line() -> None:
    """A stream cut after the data line still yields its last event on flush."""
    decoder = SseDecoder()
    assert decoder.feed(b"data: tail") == []
    assert [e.data for e in decoder.flush()] == ["tail"]


@given(st.lists(st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b),
                max_size=8), st.integers(1, 7))
def test_iter_sse_lines_round_trips(lines: list[bytes], step: int) -> None:
    """Lines split on LF come back exactly, whatever the chunk size."""
    data = b"".join(line + b"\n" for line in lines)
    chunks = [data[i:i + step] for i in range(0, len(data), step)]
    assert list(iter_sse_lines(chunks)) == lines


def test_parse_sse_event_done_chunk_and_error() -> None:
    """`[DONE]` is None, a chunk parses, an error event raises ApiError with its fields."""
    assert parse_sse_event(b"[DONE]") is None
    chunk = parse_sse_event(json.dumps(COMPLETION_CHUNK))
    assert chunk is not None
    assert (chunk.text, chunk.token_ids, chunk.prompt_token_ids) == ("He", (72, 101), (1, 2, 3))
    assert chunk.id == "cmpl-1"
    with pytest.raises(ApiError) as info:
        parse_sse_event(json.dumps(error_body("boom", type="server_error", code=500)))
    assert (info.value.message, info.value.type, info.value.code) == ("boom", "server_error", 500)
    with pytest.raises(ApiError, match="not JSON"):
        parse_sse_event("{oops")


def test_completion_logprobs_extraction() -> None:
    """Completion logprobs give token, logprob (null as -inf) and top alternatives."""
    logprobs = extract_logprobs(COMPLETION_CHUNK)
    assert logprobs[0].token == "H"
    assert logprobs[0].top == (("H", -0.5), ("h", -1.5))
    assert math.isinf(logprobs[1].logprob)
    assert extract_top_logprob(COMPLETION_CHUNK) == -0.5


def test_chat_extraction() -> None:
    """Chat responses give content, ids (prompt ids from the top level), logprobs, usage."""
    assert extract_text(CHAT_RESPONSE) == "Hi"
    assert extract_token_ids(CHAT_RESPONSE) == (72, 105)
    assert extract_prompt_token_ids(CHAT_RESPONSE) == (9, 8)
    assert extract_finish_reason(CHAT_RESPONSE) == "length"
    assert extract_usage(CHAT_RESPONSE) is not None
    assert extract_top_logprob(CHAT_RESPONSE) == -0.2
    delta = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    assert extract_text(delta) == "x"
    assert extract_finish_reason(delta) is None
    assert extract_text({"choices": []}) == ""
    assert extract_token_ids({"choices": [{"index": 0, "token_ids": ["a"]}]}) is None


def test_error_bodies_round_trip() -> None:
    """error_body builds OpenAI's shape; parse_error_body reads it and vLLM's flat form."""
    body = error_body("too long", param="prompt", code=400)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    parsed = parse_error_body(json.dumps(body).encode(), status=400)
    assert parsed is not None
    assert (parsed.message, parsed.param, parsed.status) == ("too long", "prompt", 400)
    flat = parse_error_body({"object": "error", "message": "m", "type": "t", "code": 1})
    assert flat is not None
    assert flat.type == "t"
    assert parse_error_body(b"not json") is None
    assert parse_error_body({"choices": []}) is None


def test_accumulator_joins_a_stream() -> None:
    """The accumulator joins text, ids and logprobs; finished only with a finish reason."""
    acc = StreamAccumulator()
    first = parse_sse_event(json.dumps(COMPLETION_CHUNK))
    last = {"id": "cmpl-1", "choices": [{"index": 0, "text": "y", "token_ids": [121],
                                         "finish_reason": "stop"}]}
    acc.add(first)
    assert not acc.finished
    acc.add(parse_sse_event(format_sse(last)[len(b"data: "):].strip()))
    acc.add(parse_sse_event("[DONE]"))
    assert (acc.text, acc.token_ids, acc.finish_reason, acc.done) == ("Hey", [72, 101, 121],
                                                                      "stop", True)
    assert acc.prompt_token_ids == (1, 2, 3)
    assert len(acc.logprobs) == 2


def test_request_bodies() -> None:
    """Request builders set only what is asked, ids stay ids, chat continuation sets both flags."""
    body = completion_request("m", [1, 2], max_tokens=5, seed=3, stream=True,
                              return_token_ids=True, logprobs=2, stop=["x"])
    assert body["prompt"] == [1, 2]
    assert body["stream_options"] == {"include_usage": True}
    assert (body["seed"], body["logprobs"], body["stop"]) == (3, 2, ["x"])
    assert "top_p" not in body
    chat = chat_request("m", [{"role": "assistant", "content": "He"}],
                        continue_final_message=True, top_logprobs=3)
    assert chat["continue_final_message"] is True
    assert chat["add_generation_prompt"] is False
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 3)


