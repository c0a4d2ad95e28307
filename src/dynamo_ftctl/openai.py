"""OpenAI-compatible wire helpers shared by canary, proxy, loadgen and the engine.

Pure functions over bytes and JSON-like dicts: a stream event's JSON
(`parse_sse_event`; the SSE codec itself is `dynamo_ftctl.sse`, re-exported
here as `SseDecoder`, `SseEvent`, `format_sse`, `iter_sse_events`...), field
extraction from completion and chat responses or stream chunks (text, vLLM's
`token_ids` / `prompt_token_ids` from `return_token_ids`, logprobs, finish
reason, usage), request bodies, and the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`.

Both response shapes are understood: completions (`choices[i].text`,
`logprobs.tokens/token_logprobs/top_logprobs`) and chat
(`choices[i].message.content` or `.delta.content`, `logprobs.content[]`).
A client's request body is read by `parse_request_json`: strict JSON (no NaN
or Infinity) nested at most `MAX_JSON_DEPTH` deep.
vLLM puts `prompt_token_ids` on the choice for completions and at the top level
for chat; `extract_prompt_token_ids` looks at both.

This module does no I/O and imports nothing heavy (no httpx, no aiohttp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from dynamo_ftctl.errors import FtctlError
from dynamo_ftctl.jsoncodec import loads, loads_strict
from dynamo_ftctl.sse import (
    DONE,
    SseDecoder,
    SseEvent,
    format_sse,
    iter_sse_events,
    iter_sse_lines,
)

__all__ = [
    "DONE",
    "MAX_JSON_DEPTH",
    "ApiError",
    "SseDecoder",
    "SseEvent",
    "StopFinder",
    "StreamAccumulator",
    "StreamChunk",
    "TokenLogprob",
    "Usage",
    "chat_request",
    "completion_request",
    "error_body",
    "extract_finish_reason",
    "extract_logprobs",
    "extract_prompt_token_ids",
    "extract_text",
    "extract_token_ids",
    "extract_top_logprob",
    "extract_usage",
    "format_sse",
    "iter_sse_events",
    "iter_sse_lines",
    "parse_error_body",
    "parse_request_json",
    "parse_sse_event",
]

class ApiError(FtctlError):
    """An OpenAI-style error: an HTTP error body or an SSE error event."""

    def __init__(
        self, message: str, *, type: str = "api_error",
        code: str | int | None = None, param: str | None = None, status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.status = status


# ---------------------------------------------------------------------------
# Extraction from responses and chunks


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token's logprob and the top alternatives at its position."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()

    @property
    def top_logprob(self) -> float:
        """The highest logprob at this position (the token's own if no alternatives)."""
        return max((lp for _, lp in self.top), default=self.logprob)


class Usage(msgspec.Struct, frozen=True):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _choice(obj: Mapping[str, Any], index: int) -> Mapping[str, Any] | None:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return None
    for position, choice in enumerate(choices):
        if isinstance(choice, Mapping) and choice.get("index", position) == index:
            return choice
    return None


def extract_text(obj: Mapping[str, Any], index: int = 0) -> str:
    """The text of a completion/chat response or chunk ("" when it carries none)."""
    choice = _choice(obj, index)
    if choice is None:
        return ""
    text = choice.get("text")
    if isinstance(text, str):
        return text
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, Mapping):
            content = part.get("content")
            if isinstance(content, str):
                return content
    return ""


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return tuple(value)


def extract_token_ids(obj: Mapping[str, Any], index: int = 0) -> tuple[int, ...] | None:
    """vLLM's per-choice generated `token_ids` (None when the server sent none)."""
    choice = _choice(obj, index)
    return None if choice is None else _int_tuple(choice.get("token_ids"))


def extract_prompt_token_ids(obj: Mapping[str, Any], index: int = 0) -> tuple[int, ...] | None:
    """vLLM's `prompt_token_ids`: on the choice (completions) or top level (chat)."""
    choice = _choice(obj, index)
    if choice is not None:
        ids = _int_tuple(choice.get("prompt_token_ids"))
        if ids is not None:
            return ids
    return _int_tuple(obj.get("prompt_token_ids"))


def _float(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return -math.inf  # OpenAI sends null for -inf


def extract_logprobs(obj: Mapping[str, Any], index: int = 0) -> tuple[TokenLogprob, ...]:
    """Per-token logprobs of a response or chunk, completions or chat shape."""
    choice = _choice(obj, index)
    if choice is None or not isinstance(choice.get("logprobs"), Mapping):
        return ()
    logprobs: Mapping[str, Any] = choice["logprobs"]
    content = logprobs.get("content")
    if isinstance(content, list):  # chat shape
        out = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            tops = tuple(
                (str(t.get("token", "")), _float(t.get("logprob")))
                for t in item.get("top_logprobs") or () if isinstance(t, Mapping)
            )
            out.append(TokenLogprob(str(item.get("token", "")), _float(item.get("logprob")), tops))
        return tuple(out)
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops_list = logprobs.get("top_logprobs") or []
    out = []
    for position, token in enumerate(tokens):
        value = values[position] if position < len(values) else None
        top_map = tops_list[position] if position < len(tops_list) else None
        tops = (
            tuple((str(k), _float(v)) for k, v in top_map.items())
            if isinstance(top_map, Mapping) else ()
        )
        out.append(TokenLogprob(str(token), _float(value), tops))
    return tuple(out)


def extract_top_logprob(obj: Mapping[str, Any], index: int = 0) -> float | None:
    """The top logprob at the first generated position (the canary's drift signal)."""
    logprobs = extract_logprobs(obj, index)
    return logprobs[0].top_logprob if logprobs else None


def extract_finish_reason(obj: Mapping[str, Any], index: int = 0) -> str | None:
    """`stop`, `length`, ... or None while the stream goes on."""
    choice = _choice(obj, index)
    reason = None if choice is None else choice.get("finish_reason")
    return reason if isinstance(reason, str) else None


def extract_usage(obj: Mapping[str, Any]) -> Usage | None:
    """The `usage` block, when present."""
    usage = obj.get("usage")
    if not isinstance(usage, Mapping):
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    return Usage(prompt, completion, int(usage.get("total_tokens") or prompt + completion))


# ---------------------------------------------------------------------------
# Request bodies

MAX_JSON_DEPTH = 64
"""Arrays and objects a request body may nest: OpenAI's own bodies nest under ten deep
(a tool's JSON schema a little more); 100,000 nested `[` made the proxy answer 500."""

def _nests_deeper(doc: Any, limit: int) -> bool:
    """`doc` has arrays or objects more than `limit` deep (iterative: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def parse_request_json(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A client's JSON body; `ValueError` for one that is not strict JSON (NaN,
    Infinity and numbers past a double's range are refused) or that nests arrays and
    objects deeper than `max_depth`."""
    too_deep = f"JSON nested deeper than {max_depth} arrays or objects"
    try:
        # msgspec, then json for lone-surrogate escapes ("\ud800", which the engine
        # answers); NaN, Infinity and 1e999 refused either way.
        doc = loads_strict(data)
    except RecursionError:
        raise ValueError(too_deep) from None
    if not isinstance(doc, dict | list):
        return doc
    # Counting brackets (in C) clears nearly every body without a walk: fewer of them
    # than the limit cannot nest past it, strings or not.
    opens = data.count("[") + data.count("{") if isinstance(data, str) else \
        data.count(b"[") + data.count(b"{")
    if opens > max_depth and _nests_deeper(doc, max_depth):
        raise ValueError(too_deep)
    return doc


# ---------------------------------------------------------------------------
# Errors


def error_body(
    message: str, *, type: str = "invalid_request_error",
    param: str | None = None, code: str | int | None = None,
) -> dict[str, Any]:
    """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_error_body(
    obj: Mapping[str, Any] | bytes | str, *, status: int | None = None,
) -> ApiError | None:
    """An `ApiError` from an error body (OpenAI or vLLM's flat form); None if it is not one."""
    if isinstance(obj, bytes | str):
        try:
            obj = loads(obj)
        except ValueError:
            return None
    if not isinstance(obj, Mapping):
        return None
    err = obj.get("error")
    if isinstance(err, Mapping):
        return ApiError(
            str(err.get("message", "")), type=str(err.get("type") or "api_error"),
            code=err.get("code"), param=err.get("param"), status=status,
        )
    if isinstance(err, str):
        return ApiError(err, status=status)
    if obj.get("object") == "error" and "message" in obj:  # vLLM's older flat form
        return ApiError(
            str(obj["message"]), type=str(obj.get("type") or "api_error"),
            code=obj.get("code"), param=obj.get("param"), status=status,
        )
    return None


# ---------------------------------------------------------------------------
# Stream chunks


class StreamChunk(msgspec.Struct, frozen=True):
    """One parsed stream chunk: what a consumer needs from choice `index`."""

    raw: Mapping[str, Any]
    text: str
    token_ids: tuple[int, ...] | None
    prompt_token_ids: tuple[int, ...] | None
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    usage: Usage | None

    @property
    def id(self) -> str | None:
        """The response id shared by every chunk of one request."""
        value = self.raw.get("id")
        return value if isinstance(value, str) else None


def parse_sse_event(event: SseEvent | bytes | str, index: int = 0) -> StreamChunk | None:
    """Parse one event's data: None for `[DONE]`, `ApiError` for an error event.

    Raises `ApiError` when the event is an error (`{"error": ...}`) or is not JSON.
    """
    data = event.data if isinstance(event, SseEvent) else event
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    if data.strip() == DONE:
        return None
    try:
        obj = loads(data)
    except ValueError:
        msg = f"malformed stream event (not JSON): {data[:80]!r}"
        raise ApiError(msg, type="malformed_event") from None
    if not isinstance(obj, Mapping):
        msg = f"malformed stream event (not an object): {data[:80]!r}"
        raise ApiError(msg, type="malformed_event")
    error = parse_error_body(obj)
    if error is not None:
        raise error
    return StreamChunk(
        raw=obj, text=extract_text(obj, index), token_ids=extract_token_ids(obj, index),
        prompt_token_ids=extract_prompt_token_ids(obj, index),
        logprobs=extract_logprobs(obj, index), finish_reason=extract_finish_reason(obj, index),
        usage=extract_usage(obj),
    )


class StreamAccumulator(msgspec.Struct):
    """Collects a stream's chunks into the whole answer (text, ids, logprobs, finish)."""

    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_token_ids: tuple[int, ...] | None = None
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    chunks: int = 0
    done: bool = False
    id: str | None = None

    def add(self, chunk: StreamChunk | None) -> None:
        """Fold in one parsed chunk (None marks `[DONE]`)."""
        if chunk is None:
            self.done = True
            return
        self.chunks += 1
        self.id = self.id or chunk.id
        self.text += chunk.text
        if chunk.token_ids:
            self.token_ids.extend(chunk.token_ids)
        if chunk.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = chunk.prompt_token_ids
        self.logprobs.extend(chunk.logprobs)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage

    @property
    def finished(self) -> bool:
        """True once a finish reason arrived (a stream that broke before has none)."""
        return self.finish_reason is not None


# ---------------------------------------------------------------------------
# Request bodies


def _sampling(
    body: dict[str, Any], *, max_tokens: int | None, temperature: float | None,
    top_p: float | None, seed: int | None, stop: str | Sequence[str] | None, stream: bool,
    return_token_ids: bool, extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if top_p is not None:
        body["top_p"] = top_p
    if seed is not None:
        body["seed"] = seed
    if stop is not None:
        body["stop"] = stop if isinstance(stop, str) else list(stop)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if return_token_ids:
        body["return_token_ids"] = True
    if extra:
        body.update(extra)
    return body


def completion_request(
    model: str, prompt: str | Sequence[int], *, max_tokens: int | None = 16,
    temperature: float | None = 0.0, top_p: float | None = None, seed: int | None = None,
    stop: str | Sequence[str] | None = None, stream: bool = False, logprobs: int | None = None,
    return_token_ids: bool = False, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A `/v1/completions` body; `prompt` is text or a list of token ids."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    return _sampling(
        body, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
        stream=stream, return_token_ids=return_token_ids, extra=extra,
    )


def chat_request(
    model: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int | None = 16,
    temperature: float | None = 0.0, top_p: float | None = None, seed: int | None = None,
    stop: str | Sequence[str] | None = None, stream: bool = False,
    top_logprobs: int | None = None, return_token_ids: bool = False,
    continue_final_message: bool = False, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A `/v1/chat/completions` body.

    `continue_final_message` sets vLLM's pair `continue_final_message: true,
    add_generation_prompt: false`: the model extends the last (assistant) message.
    """
    body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages]}
    if top_logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = top_logprobs
    if continue_final_message:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return _sampling(
        body, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
        stream=stream, return_token_ids=return_token_ids, extra=extra,
    )


# ---------------------------------------------------------------------------
# Stop strings


class StopFinder:
    """Stop strings over a text stream (the sim's output; the proxy's across workers).

    Holds back the last `len(longest stop) - 1` characters (they may begin a
    stop string), so a match always lies in the held text plus the new text;
    on a match, the output ends just before it (or after it, when the client
    asked for `include_stop_str_in_output`).
    """

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> StopFinder | None:
        """The finder of a request body's `stop`, or None when it has none."""
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        stops = tuple(s for s in stops if s)
        if not stops:
            return None
        return cls(stops, include=bool(body.get("include_stop_str_in_output")))

    def feed(self, text: str, *, final: bool) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string matched)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(i, len(s)) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            start, size = min(hits)
            out = self.pending[: start + size if self.include else start]
            self.pending = ""
            return out, True
        if final or self.hold == 0:
            out, self.pending = self.pending, ""
            return out, False
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held text, when the output ends for another reason."""
        out, self.pending = self.pending, ""
        return out
