"""Judging one canary answer: request bodies, response parsing, and the verdict.

Pure functions (no I/O), shared by the one-shot probe and the daemon. A reply
is parsed whatever the server sent: an OpenAI JSON body, an SSE stream (some
servers stream even when asked not to), an OpenAI error body, an HTML error
page, truncated JSON. Every way of being wrong becomes one readable reason.

Verdict kinds, in the order they are checked: `bad_response` (not a usable
answer), `token_mismatch` (first differing position and both ids),
`text_mismatch` (servers without token ids), `logit_drift` (top logprob at the
first generated position outside the recorded range).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import msgspec

from dynamo_ftctl.health.canaryset import CanaryPrompt, CanarySet
from dynamo_ftctl.health.transport import HttpReply

__all__ = [
    "Answer",
    "BadResponse",
    "CheckKind",
    "Mismatch",
    "Verdict",
    "build_request",
    "judge_answer",
    "parse_answer",
]

CheckKind = Literal[
    "ok", "unreachable", "bad_response", "token_mismatch", "text_mismatch", "logit_drift",
    "latency_spike", "model_mismatch",
]

_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


class BadResponse(Exception):
    """The worker answered, but not with a usable completion."""


class Answer(msgspec.Struct, frozen=True):
    """What a completion said: generated ids (if sent), text, first top logprob."""

    token_ids: tuple[int, ...] | None
    text: str
    top_logprob: float | None


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
    if canary_set.endpoint == "chat":
        body = chat_request(
            canary_set.model, [{"role": "user", "content": prompt.prompt}],
            max_tokens=prompt.max_tokens, temperature=0.0,
            top_logprobs=1 if want_logprobs else None,
            return_token_ids=canary_set.return_token_ids,
        )
        path = "/v1/chat/completions"
    else:
        body = completion_request(
            canary_set.model, prompt.prompt, max_tokens=prompt.max_tokens, temperature=0.0,
            logprobs=1 if want_logprobs else None, return_token_ids=canary_set.return_token_ids,
        )
        path = "/v1/completions"
    return path, json.dumps(body, separators=(",", ":")).encode()


def _snippet(body: bytes, limit: int = 80) -> str:
    text = body[:limit].decode("utf-8", errors="replace")
    text = " ".join(text.split())
    return repr(text + ("..." if len(body) > limit else ""))


def _describe_error_status(reply: HttpReply) -> str:
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
    return Answer(tuple(acc.token_ids) if acc.token_ids else None, acc.text, top)


# The usual answer, a completion with its choice at index 0, decoded by msgspec into
# just the fields a verdict reads: ~10x less CPU than json.loads and walking every
# position's logprobs (the daemon judges 30,000 answers a round for 10,000 workers).
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


class _FastDoc(msgspec.Struct):
    choices: list[_FastChoice]
    error: Any = None
    object: Any = None


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
    return Answer(None if ids is None else tuple(ids), choice.text, top)


def parse_answer(reply: HttpReply) -> Answer:
    """The answer in a reply; `BadResponse` with one readable reason otherwise."""
    from dynamo_ftctl.openai import (
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
        doc = json.loads(reply.body)
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
    return Answer(extract_token_ids(doc), extract_text(doc), extract_top_logprob(doc))


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
