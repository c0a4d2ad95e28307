"""Judging one canary answer: request bodies, response parsing, and the verdict.

Pure functions (no I/O), shared by the one-shot probe and the daemon. A reply
is parsed whatever the server sent: an OpenAI JSON body, an SSE stream (some
servers stream even when asked not to), an OpenAI error body, an HTML error
page, truncated JSON. Every way of being wrong becomes one readable reason.

Verdict kinds of an exact set, in the order they are checked: `bad_response`
(not a usable answer), `token_mismatch` (first differing position and both ids),
`text_mismatch` (servers without token ids), `logit_drift` (top logprob at the
first generated position outside the recorded range).

A shape set (`judge_shape`) compares no content, only the shape of a good
answer, in this order: `bad_response` (not a usable answer), `empty_answer`
(no text), `finish_mismatch` (a finish reason the recording never saw),
`token_count` (generated tokens outside the recorded range, or none counted),
`slow_answer` (time to first token or the whole answer beyond its baseline
times the set's tolerance).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

import msgspec

from dynamo_ftctl.health.canaryset import CanaryPrompt, CanarySet
from dynamo_ftctl.health.errors import BadResponse
from dynamo_ftctl.http1.transport import Reply
from dynamo_ftctl.jsoncodec import loads

__all__ = [
    "Answer",
    "CheckKind",
    "Mismatch",
    "Timing",
    "Verdict",
    "build_request",
    "judge_answer",
    "judge_shape",
    "parse_answer",
]

CheckKind = Literal[
    "ok", "unreachable", "bad_response", "token_mismatch", "text_mismatch", "logit_drift",
    "latency_spike", "model_mismatch", "empty_answer", "finish_mismatch", "token_count",
    "slow_answer",
]

_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


class Answer(msgspec.Struct, frozen=True):
    """What a completion said: generated ids (if sent), text, first top logprob, and
    (where the server said) its finish reason and generated token count (`usage`)."""

    token_ids: tuple[int, ...] | None
    text: str
    top_logprob: float | None
    finish_reason: str | None = None
    completion_tokens: int | None = None

    @property
    def token_count(self) -> int | None:
        """Generated tokens: the ids sent, else the usage count, else None."""
        if self.token_ids is not None:
            return len(self.token_ids)
        return self.completion_tokens


class Timing(msgspec.Struct, frozen=True):
    """How long one answer took: to its first body byte (a stream's first token) and whole."""

    ttft_s: float
    total_s: float


class Mismatch(msgspec.Struct, frozen=True):
    """Where an answer first differs from the golden one (None: the answer ended)."""

    position: int
    expected: int | str | None
    got: int | str | None


class Verdict(msgspec.Struct, frozen=True):
    """The judgement of one answer."""

    kind: CheckKind
    reason: str
    mismatch: Mismatch | None = None

    @property
    def ok(self) -> bool:
        """True when the answer matches."""
        return self.kind == "ok"


def build_request(canary_set: CanarySet, prompt: CanaryPrompt) -> tuple[str, bytes]:
    """(path, JSON body) of one canary request at temperature 0."""
    from dynamo_ftctl.openai import chat_request, completion_request

    want_logprobs = prompt.expected_top_logprob_range is not None
    # A shape set times the first token: its requests stream (with usage, for the count).
    stream = canary_set.kind == "shape"
    if canary_set.endpoint == "chat":
        body = chat_request(
            canary_set.model, [{"role": "user", "content": prompt.prompt}],
            max_tokens=prompt.max_tokens, temperature=0.0,
            top_logprobs=1 if want_logprobs else None,
            return_token_ids=canary_set.return_token_ids, stream=stream,
        )
        path = "/v1/chat/completions"
    else:
        body = completion_request(
            canary_set.model, prompt.prompt, max_tokens=prompt.max_tokens, temperature=0.0,
            logprobs=1 if want_logprobs else None, return_token_ids=canary_set.return_token_ids,
            stream=stream,
        )
        path = "/v1/completions"
    return path, json.dumps(body, separators=(",", ":")).encode()


def _snippet(body: bytes, limit: int = 80) -> str:
    text = body[:limit].decode("utf-8", errors="replace")
    text = " ".join(text.split())
    return repr(text + ("..." if len(body) > limit else ""))


def _describe_error_status(reply: Reply) -> str:
    from dynamo_ftctl.openai import parse_error_body

    error = parse_error_body(reply.body, status=reply.status)
    if error is not None:
        return f"HTTP {reply.status}: {error.message[:160]}"
    kind = reply.content_type.split(";")[0].strip() or "no content type"
    title = _TITLE.search(reply.body[:65536])
    if title is not None:
        text = " ".join(title.group(1).decode("utf-8", errors="replace").split())[:120]
        return f"HTTP {reply.status} ({kind}) page: {text!r}"
    return f"HTTP {reply.status} ({kind}): {_snippet(reply.body)}"


def _from_stream(body: bytes) -> Answer:
    from dynamo_ftctl.openai import ApiError, StreamAccumulator, iter_sse_events, parse_sse_event

    acc = StreamAccumulator()
    try:
        for event in iter_sse_events([body]):
            acc.add(parse_sse_event(event))
    except ApiError as exc:
        raise BadResponse(f"stream error: {exc.message[:160]}") from None
    if not acc.finished:
        raise BadResponse(f"stream ended without a finish reason after {acc.chunks} chunks")
    top = acc.logprobs[0].top_logprob if acc.logprobs else None
    return Answer(tuple(acc.token_ids) if acc.token_ids else None, acc.text, top,
                  acc.finish_reason, acc.usage.completion_tokens if acc.usage else None)


# The usual answer, a completion with its choice at index 0, decoded by msgspec into
# just the fields a verdict reads, far cheaper than json.loads and walking every
# position's logprobs (the daemon judges 30,000 answers a round for 10,000 workers;
# docs/benchmarks.md).
# Anything else (chat, an error body, other types, NaN) fails to decode, or is
# refused by `_fast_answer`, and takes the general path below: same verdicts.
class _FastLogprobs(msgspec.Struct):
    tokens: list[Any] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float | None] | None] | None = None
    content: Any = None


class _FastChoice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: _FastLogprobs | None = None
    finish_reason: str | None = None


class _FastUsage(msgspec.Struct):
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _FastDoc(msgspec.Struct):
    choices: list[_FastChoice]
    error: Any = None
    object: Any = None
    usage: _FastUsage | None = None


_FAST_DECODER = msgspec.json.Decoder(_FastDoc)


def _fast_answer(body: bytes) -> Answer | None:
    """The answer of a plain completion body, or None for the general path to judge."""
    try:
        doc = _FAST_DECODER.decode(body)
    except msgspec.DecodeError:
        return None
    if doc.error is not None or doc.object == "error" or not doc.choices:
        return None
    choice = doc.choices[0]
    if choice.index != 0 or choice.text is None:
        return None
    top: float | None = None
    logprobs = choice.logprobs
    if logprobs is not None:
        if logprobs.content is not None:
            return None  # the chat shape
        if logprobs.tokens:  # position 0: its best alternative, else its own logprob
            tops = logprobs.top_logprobs
            first = tops[0] if tops else None
            values = [-math.inf if v is None else v for v in (first or {}).values()]
            if values:
                top = max(values)
            else:
                own = logprobs.token_logprobs[0] if logprobs.token_logprobs else None
                top = -math.inf if own is None else own
    ids = choice.token_ids
    count = doc.usage.completion_tokens if doc.usage is not None else None
    return Answer(None if ids is None else tuple(ids), choice.text, top, choice.finish_reason,
                  count)


def _completion_tokens(doc: dict[str, Any]) -> int | None:
    """`usage.completion_tokens` when it is a count, else None."""
    usage = doc.get("usage")
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def parse_answer(reply: Reply) -> Answer:
    """The answer in a reply; `BadResponse` with one readable reason otherwise."""
    from dynamo_ftctl.openai import (
        extract_finish_reason,
        extract_text,
        extract_token_ids,
        extract_top_logprob,
        parse_error_body,
    )

    if reply.status != 200:
        raise BadResponse(_describe_error_status(reply))
    if "text/event-stream" in reply.content_type:
        return _from_stream(reply.body)
    if not reply.body:
        raise BadResponse("HTTP 200 with an empty body")
    fast = _fast_answer(reply.body)
    if fast is not None:
        return fast
    try:
        doc = loads(reply.body)
    except UnicodeDecodeError:
        raise BadResponse(f"response is not UTF-8 text: {_snippet(reply.body)}") from None
    except json.JSONDecodeError as exc:
        kind = reply.content_type.split(";")[0].strip() or "no content type"
        ended = exc.pos >= len(reply.body.rstrip()) or exc.msg.startswith("Unterminated")
        where = "truncated JSON" if ended else "invalid JSON"
        title = _TITLE.search(reply.body[:65536])
        if title is not None:
            text = " ".join(title.group(1).decode("utf-8", errors="replace").split())[:120]
            raise BadResponse(f"HTML page instead of JSON ({kind}): {text!r}") from None
        raise BadResponse(f"{where}: {exc.msg} (byte {exc.pos} of {len(reply.body)}, "
                          f"{kind}): {_snippet(reply.body)}") from None
    if not isinstance(doc, dict):
        raise BadResponse(f"expected a JSON object, got {type(doc).__name__}")
    error = parse_error_body(doc)
    if error is not None:
        raise BadResponse(f"error body: {error.message[:160]}")
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices:
        raise BadResponse("no 'choices' in the response")
    return Answer(extract_token_ids(doc), extract_text(doc), extract_top_logprob(doc),
                  extract_finish_reason(doc), _completion_tokens(doc))


def _first_difference(expected: tuple[Any, ...] | str, got: tuple[Any, ...] | str) -> Mismatch:
    for position, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            return Mismatch(position, want, have)
    position = min(len(expected), len(got))
    return Mismatch(position, expected[position] if position < len(expected) else None,
                    got[position] if position < len(got) else None)


def _show(value: int | str | None) -> str:
    return "end of answer" if value is None else repr(value)


def judge_answer(prompt: CanaryPrompt, answer: Answer) -> Verdict:
    """Compare an answer with the prompt's golden one."""
    if prompt.expected_token_ids is not None and answer.token_ids is not None:
        if answer.token_ids != prompt.expected_token_ids:
            diff = _first_difference(prompt.expected_token_ids, answer.token_ids)
            return Verdict("token_mismatch", f"token mismatch at position {diff.position}: "
                           f"expected {_show(diff.expected)}, got {_show(diff.got)}", diff)
    elif prompt.expected_text is not None:
        if answer.text != prompt.expected_text:
            diff = _first_difference(prompt.expected_text, answer.text)
            return Verdict("text_mismatch", f"text mismatch at character {diff.position}: "
                           f"expected {_show(diff.expected)}, got {_show(diff.got)}", diff)
    else:
        return Verdict("bad_response", "the server returned no token ids and the canary set "
                                       "has no expected_text for this prompt")
    low_high = prompt.expected_top_logprob_range
    if low_high is not None:
        top = answer.top_logprob
        if top is None:
            return Verdict("bad_response", "no logprobs in the response (the set checks them)")
        low, high = low_high
        if not low <= top <= high:
            return Verdict("logit_drift", f"logit drift: top logprob {top:.4f} outside "
                                          f"[{low:.4f}, {high:.4f}]")
    return Verdict("ok", "ok")


def judge_shape(prompt: CanaryPrompt, answer: Answer, timing: Timing, tolerance: float,
                ) -> Verdict:
    """Judge an answer against a shape set's prompt (see the module docstring).

    Never compares content: any non-empty answer of a recorded finish reason, a
    token count in range and a latency within `tolerance` times the baselines passes.
    """
    if not answer.text:
        return Verdict("empty_answer", "empty answer (no text generated)")
    reasons = prompt.finish_reasons or ()
    if answer.finish_reason not in reasons:
        seen = " or ".join(reasons)
        return Verdict("finish_mismatch", f"finish reason {answer.finish_reason!r}, "
                                          f"recorded {seen}")
    count = answer.token_count
    low, high = prompt.token_count or (1, prompt.max_tokens)
    if count is None:
        return Verdict("token_count", "no token count (neither token ids nor usage)")
    if not low <= count <= high:
        return Verdict("token_count", f"{count} tokens generated, recorded {low}-{high}")
    for what, took, baseline in (("time to first token", timing.ttft_s, prompt.ttft_s),
                                 ("answer", timing.total_s, prompt.total_s)):
        if baseline is not None and took > baseline * tolerance:
            return Verdict("slow_answer", f"{what} took {took * 1000:.0f} ms, over "
                                          f"{tolerance:g} x the recorded "
                                          f"{baseline * 1000:.0f} ms")
    return Verdict("ok", "ok")
