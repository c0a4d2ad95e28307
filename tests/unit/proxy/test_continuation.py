"""The continuation ledger: what a broken stream continues with, and when it must not."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_ftctl.proxy.chunk import MalformedChunk
from dynamo_ftctl.proxy.continuation import (
    NotContinuable,
    RequestRejected,
    continuation_request,
    first_request,
    prepare_request,
    retry_request,
)
from dynamo_ftctl.proxy.ledger import Endpoint, StreamLedger


def chunk(text: str, ids: list[int], finish: str | None = None,
          prompt_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return {"id": "up", "object": "text_completion", "model": "m", "choices": [choice]}


def test_continuation_carries_prompt_and_generated_ids() -> None:
    """prompt = prompt ids + generated ids, max_tokens reduced, seed and sampling kept."""
    body = prepare_request("completions", {"model": "m", "prompt": "ab", "max_tokens": 5,
                                           "temperature": 0.8, "top_p": 0.9, "seed": 3})
    ledger = StreamLedger("completions", body)
    ledger.observe(chunk("x", [120], prompt_ids=[97, 98]))
    ledger.observe(chunk("y", [121]))
    up = continuation_request(ledger)
    assert up["prompt"] == [97, 98, 120, 121]
    assert up["max_tokens"] == 3
    assert (up["seed"], up["temperature"], up["top_p"]) == (3, 0.8, 0.9)
    assert up["stream"] is True
    assert up["return_token_ids"] is True


def test_output_complete_by_length_is_not_continued() -> None:
    """A stream broken after its last token ends with finish_reason length."""
    ledger = StreamLedger("completions", {"prompt": [1, 2], "max_tokens": 1})
    ledger.observe(chunk("x", [5]))
    with pytest.raises(NotContinuable) as info:
        continuation_request(ledger)
    assert info.value.finish_reason == "length"


def test_model_max_length_stops_migration() -> None:
    """prompt + output at the model's max length: no continuation, a clean length finish."""
    ledger = StreamLedger("completions", {"prompt": [1, 2, 3]}, max_model_len=5)
    ledger.observe(chunk("a", [7]))
    ledger.observe(chunk("b", [8]))
    with pytest.raises(NotContinuable) as info:
        continuation_request(ledger)
    assert info.value.finish_reason == "length"


def test_migration_limit_is_an_error_not_a_finish() -> None:
    """Past the migration limit the request ends with an error (finish_reason None)."""
    ledger = StreamLedger("completions", {"prompt": [1]}, migration_limit=1)
    ledger.observe(chunk("a", [7]))
    ledger.note_migration()
    with pytest.raises(NotContinuable) as info:
        continuation_request(ledger)
    assert info.value.finish_reason is None


def test_more_tokens_than_asked_is_garbage() -> None:
    """A worker streaming past max_tokens is malformed (an endless stream)."""
    ledger = StreamLedger("completions", {"prompt": [1], "max_tokens": 1})
    ledger.observe(chunk("a", [7]))
    with pytest.raises(MalformedChunk):
        ledger.observe(chunk("b", [8]))


@pytest.mark.parametrize("doc", [
    [], {"choices": "x"}, {"error": {"message": "boom"}},
    {"choices": [{"index": 0, "text": 5}]}, {"choices": [{"index": 0, "token_ids": ["a"]}]},
    {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]},
])
def test_malformed_chunks_are_refused(doc: Any) -> None:
    """Anything but a one-choice completion chunk raises MalformedChunk."""
    with pytest.raises(MalformedChunk):
        StreamLedger("completions", {"prompt": [1]}).observe(doc)


def test_client_chunks_have_one_id_and_hide_ids_unless_asked() -> None:
    """Client chunks carry the proxy's id and no token ids unless return_token_ids was set."""
    ledger = StreamLedger("completions", {"prompt": [1], "model": "m", "stream": True})
    out = ledger.observe(chunk("a", [7]))
    assert out is not None
    assert out["id"] == ledger.request_id
    assert "token_ids" not in out["choices"][0]
    asked = StreamLedger("completions", {"prompt": [1], "return_token_ids": True})
    first = asked.observe(chunk("a", [7]))
    assert first is not None
    assert first["choices"][0]["token_ids"] == [7]
    assert first["prompt_token_ids"] == [1]


def test_usage_counts_every_token_once_across_workers() -> None:
    """Usage sums the generated tokens of every worker, prompt counted once."""
    ledger = StreamLedger("completions", {"prompt": [1, 2], "max_tokens": 4})
    ledger.observe(chunk("a", [7]))
    ledger.note_migration()
    ledger.start_attempt()
    ledger.observe(chunk("b", [8]))
    ledger.observe(chunk("c", [9], finish="length"))
    assert ledger.usage().to_json() == {"prompt_tokens": 2, "completion_tokens": 3,
                                        "total_tokens": 5}
    assert ledger.response()["choices"][0]["text"] == "abc"


def test_prepare_request_rejects_n_and_seeds_sampled_requests() -> None:
    """n>1 is refused; a sampled request without a seed gets one; greedy stays seedless."""
    with pytest.raises(RequestRejected):
        prepare_request("completions", {"prompt": "x", "n": 2})
    with pytest.raises(RequestRejected):
        prepare_request("chat", {"messages": "hi"})
    assert isinstance(prepare_request("completions", {"prompt": "x"})["seed"], int)
    assert "seed" not in prepare_request("completions", {"prompt": "x", "temperature": 0})


def test_stop_string_straddling_a_migration_stops_where_an_unbroken_run_stops() -> None:
    """A stop string begun on one worker and ended on the next cuts the output before it."""
    body = prepare_request("completions", {"prompt": [1], "max_tokens": 10, "stop": ["cde"],
                                           "temperature": 0})
    ledger = StreamLedger("completions", body)
    assert "stop" not in first_request(ledger)  # workers never see it: the proxy matches
    sent = [ledger.observe(chunk("ab", [2])), ledger.observe(chunk("c", [3]))]
    # The last two characters may begin the stop string: held back, not sent yet.
    assert [c["choices"][0]["text"] for c in sent if c] == ["", "a"]
    ledger.note_migration()
    assert "stop" not in continuation_request(ledger)
    last = ledger.observe(chunk("dex", [4]))
    assert last is not None
    assert (last["choices"][0]["text"], last["choices"][0]["finish_reason"]) == ("b", "stop")
    assert ledger.stopped
    assert ledger.output_text == "ab"
    assert ledger.generated_count == 3
    assert ledger.response()["choices"][0]["text"] == "ab"


def test_held_text_is_released_when_the_output_ends_without_a_stop() -> None:
    """Text held back as a possible stop prefix reaches the client at a length finish."""
    ledger = StreamLedger("chat", prepare_request("chat", {
        "messages": [{"role": "user", "content": "x"}], "stop": "zzz", "temperature": 0,
    }))
    doc = {"id": "u", "choices": [{"index": 0, "delta": {"content": "hiz"}}]}
    first = ledger.observe(doc)
    assert first is not None
    assert first["choices"][0]["delta"]["content"] == "h"
    end = ledger.finish_chunk("length")
    assert end["choices"][0]["delta"]["content"] == "iz"
    assert ledger.output_text == "hiz"


def test_stop_string_kept_in_output_when_asked() -> None:
    """include_stop_str_in_output keeps the matched stop string, as vLLM does."""
    ledger = StreamLedger("completions", {"prompt": [1], "stop": "b",
                                          "include_stop_str_in_output": True})
    out = ledger.observe(chunk("abc", [2]))
    assert out is not None
    assert out["choices"][0]["text"] == "ab"


def test_n_above_one_is_refused_naming_the_field() -> None:
    """n=2 is refused (one ledger per request) and the error names 'n'."""
    with pytest.raises(RequestRejected) as info:
        prepare_request("completions", {"prompt": "x", "n": 2})
    assert info.value.param == "n"
    with pytest.raises(RequestRejected) as info:
        prepare_request("chat", {"messages": [], "stop": 5})
    assert info.value.param == "stop"


def chat_chunk(delta: dict[str, Any], ids: list[int] | None = None,
               prompt_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    doc = {"id": "up", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    if prompt_ids is not None:
        doc["prompt_token_ids"] = prompt_ids
    return doc


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "max_completion_tokens": 10, "logprobs": True, "top_logprobs": 2,
        "chat_template_kwargs": {"x": 1}, "user": "u1"}


def test_chat_continues_as_a_completion_of_prompt_and_generated_ids() -> None:
    """A broken chat goes on through /v1/completions from ids, never from its text."""
    ledger = StreamLedger("chat", prepare_request("chat", CHAT))
    ledger.observe(chat_chunk({"role": "assistant", "content": ""}, prompt_ids=[1, 2, 3]))
    ledger.observe(chat_chunk({"content": "Hel"}, [40, 41]))
    ledger.observe(chat_chunk({"content": "lo"}, [42]))
    assert ledger.exact
    up = continuation_request(ledger)
    assert ledger.upstream_path == "/v1/completions"
    assert up["prompt"] == [1, 2, 3, 40, 41, 42]
    assert up["max_tokens"] == 7
    assert up["logprobs"] == 2
    assert up["user"] == "u1"
    assert not {"messages", "max_completion_tokens", "top_logprobs",
                "chat_template_kwargs"} & set(up)
    retry_request(ledger)
    assert ledger.upstream_path == "/v1/chat/completions"


def test_completion_chunks_of_a_chat_continuation_reach_the_client_as_chat_chunks() -> None:
    """text becomes delta.content and completions logprobs chat's content entries."""
    ledger = StreamLedger("chat", prepare_request("chat", CHAT))
    ledger.observe(chat_chunk({"role": "assistant", "content": "a"}, [40], prompt_ids=[1]))
    continuation_request(ledger)
    ledger.note_migration()
    doc = chunk("é", [43], finish="length")
    doc["choices"][0]["logprobs"] = {"tokens": ["é"], "token_logprobs": [-0.5],
                                     "top_logprobs": [{"é": -0.5, "e": -1.5}],
                                     "text_offset": [0]}
    out = ledger.observe(doc)
    assert out is not None
    assert out["object"] == "chat.completion.chunk"
    choice = out["choices"][0]
    assert choice["delta"] == {"content": "é"}
    assert "text" not in choice
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"content": [{
        "token": "é", "logprob": -0.5, "bytes": [195, 169],
        "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                         {"token": "e", "logprob": -1.5, "bytes": [101]}]}]}
    assert ledger.generated_ids == [40, 43]
    assert ledger.output_text == "aé"


@pytest.mark.parametrize("why", ["tools", "tool_calls", "reasoning_content", "no_prompt_ids"])
def test_chat_falls_back_to_text_when_ids_cannot_reproduce_it(why: str) -> None:
    """Tools, parsed deltas or missing prompt ids: the chat goes on as a chat, with its text."""
    body = dict(CHAT)
    if why == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    ledger = StreamLedger("chat", prepare_request("chat", body))
    first = chat_chunk({"role": "assistant", "content": ""},
                       prompt_ids=None if why == "no_prompt_ids" else [1])
    ledger.observe(first)
    delta: dict[str, Any] = {"content": "ok"}
    if why in ("tool_calls", "reasoning_content"):
        delta[why] = [{"index": 0}] if why == "tool_calls" else "thinking"
    ledger.observe(chat_chunk(delta, [7]))
    assert not ledger.exact
    up = continuation_request(ledger)
    assert ledger.upstream_path == "/v1/chat/completions"
    assert up["messages"][-1] == {"role": "assistant", "content": "ok"}
    assert up["continue_final_message"] is True


def test_request_ids_are_uuids_and_a_client_id_is_kept() -> None:
    """Without a client id each ledger gets a fresh version-4 UUID; with one, that one."""
    import uuid

    a, b = StreamLedger("chat", dict(CHAT)), StreamLedger("completions", {"prompt": "x"})
    assert a.trace_id != b.trace_id
    for ledger in (a, b):
        parsed = uuid.UUID(ledger.trace_id)
        assert (parsed.version, str(parsed)) == (4, ledger.trace_id)
    assert a.request_id == f"chatcmpl-{a.trace_id}"
    assert b.request_id == f"cmpl-{b.trace_id}"
    mine = StreamLedger("chat", dict(CHAT), trace_id="trace-42")
    assert (mine.trace_id, mine.request_id) == ("trace-42", "chatcmpl-trace-42")


def held_back_run(body: dict[str, Any]) -> StreamLedger:
    """A stream whose last two ids carried no text yet (the first bytes of a character)."""
    ledger = StreamLedger("completions", prepare_request("completions", body))
    ledger.observe(chunk("ab", [5], prompt_ids=[1, 2]))
    ledger.observe(chunk("", [6]))
    ledger.observe(chunk("", [7]))
    return ledger


def test_a_continuation_starts_before_ids_whose_text_was_held_back() -> None:
    """The ids of a character cut in two are generated again: the prompt ends where the
    text does, max_tokens and usage count them once, the client gets their text."""
    ledger = held_back_run({"prompt": "x", "max_tokens": 10, "temperature": 0})
    up = continuation_request(ledger)
    assert up["prompt"] == [1, 2, 5]
    assert up["max_tokens"] == 9
    ledger.note_migration()
    out = ledger.observe(chunk("", [6]))
    assert out is None or out["choices"][0].get("text") == ""
    out = ledger.observe(chunk("é", [7]))
    assert out is not None
    assert out["choices"][0]["text"] == "é"
    ledger.observe(chunk("z", [8], finish="length"))
    assert ledger.generated_ids == [5, 6, 7, 8]
    assert ledger.output_text == "abéz"
    assert ledger.usage().completion_tokens == 4


def test_rewound_ids_the_client_already_has_are_not_sent_twice() -> None:
    """With ids asked for, a greedy continuation's repeated ids reach the client once."""
    ledger = held_back_run({"prompt": "x", "max_tokens": 10, "temperature": 0,
                            "return_token_ids": True})
    assert continuation_request(ledger)["prompt"] == [1, 2, 5]
    ledger.note_migration()
    out = ledger.observe(chunk("é", [6, 7]))
    assert out is not None
    assert out["choices"][0]["token_ids"] == []
    out = ledger.observe(chunk("z", [8]))
    assert out is not None
    assert out["choices"][0]["token_ids"] == [8]


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": 10, "temperature": 0.9, "seed": 1, "return_token_ids": True},
    {"prompt": "x", "max_tokens": 3, "temperature": 0},
])
def test_no_rewind_when_the_client_saw_sampled_ids_or_nothing_is_left(
        body: dict[str, Any]) -> None:
    """Sampled ids the client saw may not come again; a full output is not continued."""
    ledger = held_back_run(body)
    if body["max_tokens"] == 3:
        with pytest.raises(NotContinuable):
            continuation_request(ledger)
        return
    assert continuation_request(ledger)["prompt"] == [1, 2, 5, 6, 7]


def test_unrendered_observe_answers_none_where_a_chunk_would_not_go() -> None:
    """`observe(render=False)` (a non-streamed client's) is None exactly where a rendered
    chunk is None (a second worker's role-only chat chunk, an empty delta), same answer."""
    def chat_chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                             "token_ids": []}]}

    def text_chunk(text: str, finish: str | None = None) -> dict[str, object]:
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    chats = [chat_chunk({"role": "assistant"}), chat_chunk({"content": "a"}),
             chat_chunk({"role": "assistant"}), chat_chunk({}),
             chat_chunk({"content": "b"}, "length")]
    texts = [text_chunk(""), text_chunk("a"), text_chunk("b", "stop")]
    cases: list[tuple[Endpoint, list[dict[str, object]], dict[str, Any]]] = [
        ("chat", chats, {"messages": [{"role": "user", "content": "x"}]}),
        ("completions", texts, {"prompt": "x", "stop": ["zz"]}),
    ]
    for endpoint, docs, body in cases:
        rendered = StreamLedger(endpoint, dict(body))
        plain = StreamLedger(endpoint, dict(body))
        for doc in docs:
            assert (rendered.observe(doc) is None) == (plain.observe(doc, render=False) is None)
        assert plain.response() | {"created": 0, "id": ""} \
            == rendered.response() | {"created": 0, "id": ""}


def test_own_context_is_the_prompt_or_what_an_earlier_attempt_reached_there() -> None:
    """A worker's own prefix cache holds at most the client's prompt, or the context its
    earlier attempt of the request reached (a way back to a worker it was cut on)."""
    body = prepare_request("completions", {"model": "m", "prompt": "ab", "max_tokens": 9})
    ledger = StreamLedger("completions", body)
    ledger.start_attempt("a")
    ledger.observe(chunk("x", [120], prompt_ids=[97, 98]))
    ledger.observe(chunk("y", [121]))
    ledger.start_attempt("b")  # cut on a after 2 tokens
    assert (ledger.own_context("a"), ledger.own_context("b")) == (4, 2)
    for tid in (122, 123, 124):
        ledger.observe(chunk("z", [tid]))
    assert ledger.own_context("b") == 2  # its own attempt, still under way, not counted
    ledger.start_attempt("a")  # cut on b after 3 more
    assert (ledger.own_context("a"), ledger.own_context("b"), ledger.own_context("c")) \
        == (4, 7, 2)
