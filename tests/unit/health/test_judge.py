"""Judging answers: every kind of wrong answer becomes one readable verdict."""

from __future__ import annotations

import json

import pytest

from dynamo_ftctl.health.canaryset import CanaryPrompt, CanarySet
from dynamo_ftctl.health.errors import BadResponse
from dynamo_ftctl.health.judge import (
    Answer,
    build_request,
    judge_answer,
    parse_answer,
)
from dynamo_ftctl.http1 import Reply
from dynamo_ftctl.structs import replace

PROMPT = CanaryPrompt(name="p", prompt="hi", max_tokens=4, expected_token_ids=(5, 6, 7, 8),
                      expected_text="abcd", expected_top_logprob_range=(-1.0, -0.5))


def completion(ids: list[int] | None, text: str = "abcd", top: float = -0.7) -> bytes:
    choice: dict[str, object] = {
        "index": 0, "text": text, "finish_reason": "length",
        "logprobs": {"tokens": list(text), "token_logprobs": [top] * len(text),
                     "top_logprobs": [{c: top} for c in text]},
    }
    if ids is not None:
        choice["token_ids"] = ids
    return json.dumps({"choices": [choice]}).encode()


def reply(body: bytes, status: int = 200, kind: str = "application/json") -> Reply:
    return Reply(status, body, {"content-type": kind} if kind else {})


def test_request_is_greedy_and_asks_for_ids_and_logprobs() -> None:
    """The request body runs at temperature 0 with token ids and one logprob."""
    canary_set = CanarySet(model="m", prompts=(PROMPT,))
    path, body = build_request(canary_set, PROMPT)
    doc = json.loads(body)
    assert path == "/v1/completions"
    assert doc["temperature"] == 0.0
    assert doc["return_token_ids"] is True
    assert doc["logprobs"] == 1
    assert doc["max_tokens"] == 4


def test_matching_answer_is_ok() -> None:
    """Same ids and a top logprob in range: ok."""
    assert judge_answer(PROMPT, parse_answer(reply(completion([5, 6, 7, 8])))).ok


def test_token_mismatch_names_first_position_and_both_tokens() -> None:
    """The verdict points at the first differing position with expected and got ids."""
    verdict = judge_answer(PROMPT, parse_answer(reply(completion([5, 6, 99, 8]))))
    assert verdict.kind == "token_mismatch"
    assert verdict.mismatch is not None
    assert (verdict.mismatch.position, verdict.mismatch.expected, verdict.mismatch.got) == (
        2, 7, 99)
    assert "position 2" in verdict.reason


def test_short_answer_is_a_mismatch_at_its_end() -> None:
    """An answer that stops early differs where it ends."""
    verdict = judge_answer(PROMPT, Answer((5, 6), "ab", -0.7))
    assert verdict.kind == "token_mismatch"
    assert verdict.mismatch is not None
    assert (verdict.mismatch.position, verdict.mismatch.got) == (2, None)


def test_text_is_compared_when_the_server_sends_no_ids() -> None:
    """Without token ids the golden text decides, and the first differing character is named."""
    verdict = judge_answer(PROMPT, parse_answer(reply(completion(None, text="abXd"))))
    assert verdict.kind == "text_mismatch"
    assert verdict.mismatch is not None
    assert verdict.mismatch.position == 2


def test_logit_drift_outside_range() -> None:
    """Right tokens with a top logprob outside the recorded range is logit drift."""
    verdict = judge_answer(PROMPT, parse_answer(reply(completion([5, 6, 7, 8], top=-2.0))))
    assert verdict.kind == "logit_drift"
    assert "-2.0000" in verdict.reason


@pytest.mark.parametrize(("got", "words"), [
    (reply(b"<html><head><title>502 Bad Gateway</title></head></html>", 502, "text/html"),
     "HTTP 502 (text/html) page: '502 Bad Gateway'"),
    (reply(completion([5, 6, 7, 8])[:40]), "truncated JSON"),
    (reply(b"<html><title>Oops</title>", 200, "text/html"), "HTML page instead of JSON"),
    (reply(b'{"error": {"message": "model not loaded", "type": "x"}}', 500),
     "HTTP 500: model not loaded"),
    (reply(b'{"object": "list"}'), "no 'choices'"),
    (reply(b""), "empty body"),
    (reply(b"[1, 2]"), "expected a JSON object"),
    (reply(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', 200, "text/event-stream"),
     "stream ended without a finish reason"),
])
def test_garbage_becomes_one_clear_reason(got: Reply, words: str) -> None:
    """HTML pages, truncated JSON, error bodies and unfinished streams are BadResponse."""
    with pytest.raises(BadResponse) as info:
        parse_answer(got)
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_streamed_answer_is_understood() -> None:
    """A server that streams anyway is judged on the assembled stream."""
    chunks = [{"choices": [{"index": 0, "text": c, "token_ids": [i]}]}
              for c, i in zip("abc", (5, 6, 7), strict=True)]
    chunks.append({"choices": [{"index": 0, "text": "d", "token_ids": [8],
                                "finish_reason": "length"}]})
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    answer = parse_answer(reply(body + b"data: [DONE]\n\n", 200, "text/event-stream"))
    assert answer.token_ids == (5, 6, 7, 8)
    assert answer.text == "abcd"


def test_ids_expected_but_absent_and_no_text_is_bad_response() -> None:
    """A set with only ids against a server without ids cannot judge: bad_response."""
    prompt = replace(PROMPT, expected_text=None)
    verdict = judge_answer(prompt, Answer(None, "abcd", -0.7))
    assert verdict.kind == "bad_response"


# Bodies the msgspec fast path reads, and bodies it must hand to the general path
# (json.loads and openai.extract_*): the verdicts are the same either way.
_AGREEING = [
    completion([5, 6, 7, 8]),
    completion(None),
    completion([5, 6, 7, 8], top=-3),
    json.dumps({"choices": [{"text": "ab", "token_ids": [1, 2]}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
               ).encode(),
    json.dumps({"choices": [{"text": "ab", "finish_reason": None}], "usage": {}}).encode(),
    json.dumps({"choices": [{"index": 0, "text": "ab", "logprobs": None}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "logprobs": {"tokens": [], "top_logprobs": []}}]}
               ).encode(),
    json.dumps({"choices": [{"text": "ab", "logprobs": {
        "tokens": ["a"], "token_logprobs": [-0.25], "top_logprobs": [{}]}}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "logprobs": {
        "tokens": ["a"], "token_logprobs": [None], "top_logprobs": [None]}}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "logprobs": {
        "tokens": ["a"], "token_logprobs": [-1], "top_logprobs": [{"a": None, "b": -2}]}}]}
               ).encode(),
    json.dumps({"choices": [{"text": "ab", "logprobs": {"tokens": ["a"]}}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "token_ids": []}], "error": None}).encode(),
]
_DECLINED = [
    json.dumps({"choices": [{"index": 0, "message": {"content": "ab"}}]}).encode(),
    json.dumps({"choices": [{"index": 1, "text": "x"}, {"index": 0, "text": "ab"}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "token_ids": [True, 2]}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "token_ids": "12"}]}).encode(),
    json.dumps({"choices": [{"text": "ab", "logprobs": {"content": [
        {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]}]}}]}
               ).encode(),
    json.dumps({"choices": [{"text": "ab"}], "error": {"message": "boom"}}).encode(),
    json.dumps({"choices": [{"text": "ab"}], "object": "error", "message": "boom"}).encode(),
    b'{"choices": [{"text": "ab", "logprobs": {"tokens": ["a"], "token_logprobs": [NaN]}}]}',
    json.dumps({"choices": []}).encode(),
    json.dumps([1, 2]).encode(),
    b"\xff\xfe not utf-8",
]


def _general(body: bytes) -> Answer | str:
    """The answer as the general path reads it, or a word for a BadResponse."""
    from dynamo_ftctl.health.judge import _completion_tokens
    from dynamo_ftctl.openai import (
        extract_finish_reason,
        extract_text,
        extract_token_ids,
        extract_top_logprob,
    )

    try:
        doc = json.loads(body)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) \
            or not doc["choices"] or ("error" in doc and doc["error"] is not None) \
            or doc.get("object") == "error":
        return "not an answer"
    return Answer(extract_token_ids(doc), extract_text(doc), extract_top_logprob(doc),
                  extract_finish_reason(doc), _completion_tokens(doc))


@pytest.mark.parametrize("body", _AGREEING)
def test_the_fast_path_reads_plain_completions_as_the_general_path_does(body: bytes) -> None:
    """A plain completion decoded by msgspec gives the general path's ids, text, top
    logprob, finish reason and token count, so the verdict cannot depend on which path
    read it."""
    from dynamo_ftctl.health.judge import _fast_answer

    fast = _fast_answer(body)
    assert fast is not None
    assert fast == _general(body)
    assert parse_answer(reply(body)) == fast


@pytest.mark.parametrize("body", _DECLINED)
def test_the_fast_path_leaves_every_other_shape_to_the_general_path(body: bytes) -> None:
    """Chat answers, error bodies, odd types, NaN, other choices first: not read fast."""
    from dynamo_ftctl.health.judge import _fast_answer

    assert _fast_answer(body) is None
    general = _general(body)
    if isinstance(general, Answer):
        assert parse_answer(reply(body)) == general
    else:
        with pytest.raises(BadResponse):
            parse_answer(reply(body))
