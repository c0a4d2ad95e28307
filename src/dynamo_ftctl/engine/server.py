"""The `ftctl sim` HTTP server: OpenAI API, health, metrics, sleep/wake, KV and faults.

Routes (vLLM-compatible where vLLM has them):

    GET  /v1/models                 the served model, with `max_model_len`
    POST /v1/completions            stream or not; prompt text or token ids
    POST /v1/chat/completions       stream or not; `continue_final_message`
    GET  /health                    200 serving, 503 starting or asleep
    GET  /metrics                   Prometheus text, vLLM names
    POST /sleep?level=1|2, POST /wake_up (bearer token), GET /is_sleeping
    GET  /admin/kv/{request_id}     KV export (`kv.wire` format); `?abort=true` stops it
    POST /admin/kv/import           resume a request from an export (`?stream=false`)
    POST /admin/fault, GET /admin/fault   fault injection (bearer token)

Like vLLM (pydantic `extra="forbid"`), a generation request with a field the
sim does not know is a 400 naming the field (`lenient_fields` turns this off),
and so is text the tokenizer cannot encode (a lone surrogate escape such as
`"\\ud800"` in the prompt, a message's content or a stop string): never a 500,
which a proxy would take for a failing worker,
and the first generation after start waits `warmup_s` more (real engines
compile and allocate on their first batch; /health answers meanwhile).

Request ids: an `X-Request-Id` header names the request (the proxy and
`ftctl migrate` address requests by it); the response carries it in the same
header and as its `id`. JSON is written with ASCII escapes, so ids that are
not UTF-8 travel as `\\udcXX` and come back exactly (see `tokenizer`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _enc  # what json.dumps uses for str
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.auth import check_bearer
from dynamo_ftctl.engine.config import EngineConfig
from dynamo_ftctl.engine.faults import FaultSpec, FaultState, parse_fault, xid_crash_lines
from dynamo_ftctl.engine.tokenizer import IncrementalDetokenizer
from dynamo_ftctl.errors import FtctlError, InvalidInput
from dynamo_ftctl.openai import DONE, StopFinder, error_body, format_sse, parse_request_json
from dynamo_ftctl.redact import install_log_redaction

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from dynamo_ftctl.engine.driver import AsyncEngine
    from dynamo_ftctl.engine.metrics import EngineMetrics
    from dynamo_ftctl.engine.scheduler import Engine, EngineRequest, RequestParams
    from dynamo_ftctl.engine.tokenizer import SimTokenizer

__all__ = ["DroppedByFault", "ServerSettings", "ServerState", "create_app", "serve"]

_log = logging.getLogger("ftctl.sim")
REQUEST_ID_HEADER = "X-Request-Id"
# vLLM clamps -inf logprobs to this so that JSON stays valid.
_MIN_LOGPROB = -9999.0


class DroppedByFault(Exception):
    """Raised inside a stream to drop its connection (the `disconnect` fault)."""


@dataclass(frozen=True)
class ServerSettings:
    """How to run one engine server."""

    config: EngineConfig
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    admin_token: str | None = None
    faults: tuple[FaultSpec, ...] = ()
    pci_bus_id: str = "0000:3b:00"
    pid_file: Path | None = None
    threads: int | None = 1
    # Real engines take seconds to minutes on their first request (graph capture,
    # compilation); vLLM's first request once took over 20 s in our drills.
    warmup_s: float = 1.0
    lenient_fields: bool = False  # True: ignore unknown request fields (the pre-pydantic way)


@dataclass
class ServerState:
    """Everything the handlers share."""

    settings: ServerSettings
    engine: Engine
    driver: AsyncEngine
    faults: FaultState
    metrics: EngineMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    warm: bool = False
    warming: asyncio.Future[None] | None = None


# ---------------------------------------------------------------------------
# Small helpers


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    from starlette.responses import Response

    return Response(json.dumps(obj, separators=(",", ":")).encode(), status_code=status,
                    media_type="application/json", headers=dict(headers or {}))


def _error(message: str, status: int = 400, *, kind: str = "invalid_request_error",
           param: str | None = None, headers: Mapping[str, str] | None = None) -> Response:
    return _json(error_body(message, type=kind, param=param, code=status), status, headers)


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _get(body: Mapping[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        msg = f"'{key}' must be {kinds[0].__name__}, got {value!r}"
        raise _ParamError(msg, key)
    if not isinstance(value, kinds):
        msg = f"'{key}' must be {kinds[0].__name__}, got {value!r}"
        raise _ParamError(msg, key)
    return value


class _ParamError(InvalidInput):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class _Options:
    """Per-request options that the HTTP layer (not the engine) handles."""

    stream: bool
    include_usage: bool
    return_token_ids: bool
    stop: tuple[str, ...]
    logprobs: int | None  # completions: top count; chat: top_logprobs (0 = chosen only)


# The request fields vLLM accepts that the sim implements, or can ignore without changing
# what it computes (who asks, scheduling hints, how specials are rendered).
_FIELDS_BOTH = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "stream", "stream_options", "n", "ignore_eos", "min_tokens", "return_token_ids", "logprobs",
    "user", "priority", "skip_special_tokens", "spaces_between_special_tokens",
    *("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"),
})
_FIELDS = {
    False: _FIELDS_BOTH | {"prompt", "echo"},
    True: _FIELDS_BOTH | {"messages", "max_completion_tokens", "top_logprobs",
                          "continue_final_message", "add_generation_prompt"},
}
# Sampling knobs the sim does not implement: accepted only at the value that changes nothing.
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0}


def _check_fields(body: Mapping[str, Any], *, chat: bool) -> None:
    """400 for an unknown field or a sampling knob the sim cannot honour (as vLLM's pydantic
    models with `extra="forbid"` reject the first)."""
    unknown = sorted(set(body) - _FIELDS[chat])
    if unknown:
        msg = f"Extra inputs are not permitted: {unknown[0]!r}"
        if len(unknown) > 1:
            msg += f" (also: {', '.join(map(repr, unknown[1:]))})"
        raise _ParamError(msg, unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            msg = f"'{name}' is not implemented by ftctl sim (only {neutral} is accepted)"
            raise _ParamError(msg, name)


def _sampling(body: Mapping[str, Any], prompt_len: int, max_len: int,
              default_max: int | None, num_top: int) -> RequestParams:
    from dynamo_ftctl.engine.scheduler import RequestParams

    if _get(body, "n", (int,), 1) != 1:
        msg = "only n=1 is supported"
        raise _ParamError(msg, "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max(max_len - prompt_len, 1)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        msg = f"'max_tokens' must be a positive integer, got {max_tokens!r}"
        raise _ParamError(msg, "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = int(_get(body, "top_k", (int,), 0))
    if temperature < 0 or not 0 < top_p <= 1:
        msg = "temperature must be >= 0 and top_p in (0, 1]"
        raise _ParamError(msg, "temperature")
    seed = _get(body, "seed", (int,), None)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    min_tokens = _get(body, "min_tokens", (int,), 0)
    if min_tokens < 0:
        msg = f"'min_tokens' must be >= 0, got {min_tokens}"
        raise _ParamError(msg, "min_tokens")
    return RequestParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        seed=seed, ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)), num_top=num_top,
        stop_token_ids=tuple(int(t) for t in stop_ids), min_tokens=min_tokens,
    )


def _options(body: Mapping[str, Any], logprobs: int | None, tok: SimTokenizer) -> _Options:
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        msg = "'stop' must be a string or a list of strings"
        raise _ParamError(msg, "stop")
    for stop_string in stops:  # one the model could never write
        _check_encodable(tok, stop_string, "stop")
    stream_options = body.get("stream_options") or {}
    return _Options(
        stream=bool(_get(body, "stream", (bool,), False)),
        include_usage=bool(isinstance(stream_options, dict)
                           and stream_options.get("include_usage")),
        return_token_ids=bool(_get(body, "return_token_ids", (bool,), False)),
        stop=stops, logprobs=logprobs,
    )


# ---------------------------------------------------------------------------
# The generation core shared by completions, chat and KV import


@dataclass
class _Step:
    """One token's rendering: its text delta and logprob entry."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...]
    finish_reason: str | None


async def _step_batches(state: ServerState, request: EngineRequest, options: _Options,
                        start: Callable[[], object], arrival: float,
                        ) -> AsyncIterator[list[_Step]]:
    """Token steps of a request, detokenized, stop strings applied, faults enforced.

    Each batch holds the tokens that were waiting when the stream woke up (one in
    the steady state), so a stream that fell behind catches up in one write.
    """
    detok = IncrementalDetokenizer(state.engine.tokenizer, request.prompt_ids)
    stopper = StopFinder(options.stop)
    sent = 0
    first = True
    async for events in state.driver.follow_batches(request, start):
        steps: list[_Step] = []
        for event in events:
            if event.error is not None:
                if steps:
                    yield steps
                raise _StreamFailed(event.error)
            token = event.token
            if token is None:
                continue
            if first:
                state.metrics.ttft.observe(time.monotonic() - arrival)
                first = False
            finish = event.finish_reason
            text = detok.push(token.token_id)
            if finish is not None:
                text += detok.flush()
            text, hit = stopper.feed(text, final=finish is not None)
            if hit:
                finish = "stop"
            sent += 1
            steps.append(_Step(token.token_id, text, token.logprob, token.top, finish))
            if finish is not None:
                yield steps
                state.metrics.e2e.observe(time.monotonic() - arrival)
                return
            limit = state.faults.disconnect_after
            if limit is not None and sent >= limit:
                yield steps
                raise DroppedByFault(request.request_id)
        if steps:
            yield steps


class _StreamFailed(Exception):
    """The engine ended a request with an error (aborted, engine asleep)."""


def _completion_logprobs(state: ServerState, steps: Sequence[_Step], offset: int) -> dict[str, Any]:
    tok = state.engine.tokenizer
    offsets = []
    for step in steps:
        offsets.append(offset)
        offset += len(step.text)
    return {
        "tokens": [tok.token_text(s.token_id) for s in steps],
        "token_logprobs": [_lp(s.logprob) for s in steps],
        "top_logprobs": [{tok.token_text(i): _lp(v) for i, v in s.top} for s in steps],
        "text_offset": offsets,
    }


def _chat_logprobs(state: ServerState, steps: Sequence[_Step]) -> dict[str, Any]:
    tok = state.engine.tokenizer
    return {"content": [
        {
            "token": tok.token_text(s.token_id), "logprob": _lp(s.logprob),
            "bytes": tok.token_bytes(s.token_id),
            "top_logprobs": [
                {"token": tok.token_text(i), "logprob": _lp(v), "bytes": tok.token_bytes(i)}
                for i, v in s.top
            ],
        }
        for s in steps
    ]}


def _usage(prompt_len: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion}


@dataclass(frozen=True)
class _Job:
    """A validated generation request and how to answer it."""

    request: EngineRequest
    options: _Options
    chat: bool
    prompt_ids: list[int]
    start: Callable[[], object]
    arrival: float


def _headers(request_id: str) -> dict[str, str]:
    return {REQUEST_ID_HEADER: request_id}


async def _respond(state: ServerState, job: _Job) -> Response:
    if job.options.stream:
        from dynamo_ftctl.engine.stream import EventStream

        return EventStream(_sse(state, job), headers={**_headers(job.request.request_id),
                                                     "Cache-Control": "no-cache"})
    steps: list[_Step] = []
    try:
        async for batch in _step_batches(state, job.request, job.options, job.start,
                                         job.arrival):
            steps.extend(batch)
    except _StreamFailed as exc:
        return _error(str(exc), 503, kind="service_unavailable",
                      headers=_headers(job.request.request_id))
    text = "".join(s.text for s in steps)
    finish = steps[-1].finish_reason if steps else "abort"
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if job.chat:
        choice["message"] = {"role": "assistant", "content": text}
        if job.options.logprobs is not None:
            choice["logprobs"] = _chat_logprobs(state, steps)
    else:
        choice["text"] = text
        if job.options.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(state, steps, 0)
    if job.options.return_token_ids:
        choice["token_ids"] = [s.token_id for s in steps]
    body: dict[str, Any] = {
        "id": job.request.request_id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()), "model": state.engine.config.name, "choices": [choice],
        "usage": _usage(len(job.prompt_ids), len(steps)),
    }
    if job.options.return_token_ids:
        if job.chat:
            body["prompt_token_ids"] = job.prompt_ids
        else:
            choice["prompt_token_ids"] = job.prompt_ids
    return _json(body, headers=_headers(job.request.request_id))


SERVER_TTFT_FIELD = "ftctl_server_ttft_ms"
"""Top-level field of a stream's finishing chunk: this server's own TTFT for the request
(arrival of the request -> its first token chunk handed to the socket), in ms."""


class _ChunkWriter:
    """SSE chunks of one stream, byte for byte what `format_sse(dict)` writes.

    Token chunks without logprobs (nearly all of them) are filled into a prefix
    built once per stream, with the C string encoder `json.dumps` itself uses:
    no dict and no JSON encoder per token.
    """

    __slots__ = ("chat", "created", "kind", "model", "prefix", "rid", "token_ids")

    def __init__(self, rid: str, model: str, created: int, *, chat: bool,
                 token_ids: bool) -> None:
        self.rid, self.model, self.created, self.chat = rid, model, created, chat
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.token_ids = token_ids
        self.prefix = (f'data: {{"id":{_enc(rid)},"object":"{self.kind}","created":{created},'
                       f'"model":{_enc(model)},"choices":[{{"index":0,"finish_reason":')

    def chunk(self, choice: dict[str, Any], **top: Any) -> bytes:
        """Any chunk, through the JSON encoder."""
        return format_sse({"id": self.rid, "object": self.kind, "created": self.created,
                           "model": self.model, "choices": [choice], **top})

    def token(self, step: _Step, ttft_ms: float | None) -> str:
        """A plain token chunk (no logprobs, no prompt ids) as text."""
        finish = "null" if step.finish_reason is None else _enc(step.finish_reason)
        body = (f'{{"content":{_enc(step.text)}}}' if self.chat else _enc(step.text))
        ids = f',"token_ids":[{step.token_id}]' if self.token_ids else ""
        tail = "" if ttft_ms is None else f',"{SERVER_TTFT_FIELD}":{ttft_ms!r}'
        field_name = '"delta"' if self.chat else '"text"'
        return f"{self.prefix}{finish},{field_name}:{body}{ids}}}]{tail}}}\n\n"


async def _sse(state: ServerState, job: _Job) -> AsyncGenerator[bytes, None]:
    """The body of a stream: one write per batch of steps, the end in the last write."""
    options = job.options
    writer = _ChunkWriter(job.request.request_id, state.engine.config.name, int(time.time()),
                          chat=job.chat, token_ids=options.return_token_ids)
    count = 0
    offset = 0
    ttft_ms: float | None = None
    arrival = job.arrival
    fast = options.logprobs is None

    if job.chat:
        first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}
        extra = {"prompt_token_ids": job.prompt_ids} if options.return_token_ids else {}
        yield writer.chunk(first, **extra)
    try:
        async for batch in _step_batches(state, job.request, options, job.start, arrival):
            parts: list[bytes] = []
            for step in batch:
                end_ttft: float | None = None
                if step.finish_reason is not None:
                    if ttft_ms is None:  # the first token finishes: written right now
                        ttft_ms = round((time.monotonic() - arrival) * 1000, 3)
                    end_ttft = ttft_ms
                if fast and (job.chat or count or not options.return_token_ids):
                    parts.append(writer.token(step, end_ttft).encode())
                else:
                    parts.append(_slow_chunk(state, writer, job, step, offset=offset,
                                                 count=count, ttft_ms=end_ttft))
                offset += len(step.text)
                count += 1
            if batch[-1].finish_reason is not None:
                if options.include_usage:
                    parts.append(format_sse({
                        "id": writer.rid, "object": writer.kind, "created": writer.created,
                        "model": writer.model, "choices": [],
                        "usage": _usage(len(job.prompt_ids), count)}))
                parts.append(format_sse(DONE))
                yield b"".join(parts)
                return
            yield b"".join(parts)
            if ttft_ms is None:  # resumed once the first token's chunk went to the socket
                ttft_ms = round((time.monotonic() - arrival) * 1000, 3)
    except _StreamFailed as exc:
        yield format_sse(error_body(str(exc), type="service_unavailable", code=503))
        return
    # Ended without a finish reason (the request was aborted without an error).
    if options.include_usage:
        yield format_sse({"id": writer.rid, "object": writer.kind, "created": writer.created,
                          "model": writer.model, "choices": [],
                          "usage": _usage(len(job.prompt_ids), count)})
    yield format_sse(DONE)


def _slow_chunk(state: ServerState, writer: _ChunkWriter, job: _Job, step: _Step, *,
                offset: int, count: int, ttft_ms: float | None) -> bytes:
    """A token chunk with logprobs or prompt ids, through the JSON encoder."""
    options = job.options
    choice: dict[str, Any] = {"index": 0, "finish_reason": step.finish_reason}
    if job.chat:
        choice["delta"] = {"content": step.text}
        if options.logprobs is not None:
            choice["logprobs"] = _chat_logprobs(state, [step])
    else:
        choice["text"] = step.text
        if options.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(state, [step], offset)
        if options.return_token_ids and count == 0:
            choice["prompt_token_ids"] = job.prompt_ids
    if options.return_token_ids:
        choice["token_ids"] = [step.token_id]
    top = {} if ttft_ms is None else {SERVER_TTFT_FIELD: ttft_ms}
    return writer.chunk(choice, **top)


# ---------------------------------------------------------------------------
# Handlers


def _asleep_response(state: ServerState) -> Response | None:
    if state.engine.asleep or not state.driver.ready:
        what = "asleep" if state.engine.asleep else "starting"
        return _error(f"engine is {what}", 503, kind="service_unavailable")
    return None


async def _read_json(request: Request) -> dict[str, Any]:
    try:
        body = parse_request_json(await request.body())
    except ValueError as exc:
        msg = f"request body is not valid JSON: {exc}"
        raise _ParamError(msg) from None
    if not isinstance(body, dict):
        msg = "request body must be a JSON object"
        raise _ParamError(msg)
    return body


def _request_id(request: Request, prefix: str) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "").strip()
    return given or f"{prefix}-{uuid.uuid4().hex}"


def _check_model(state: ServerState, body: Mapping[str, Any]) -> Response | None:
    model = body.get("model")
    if model is not None and model != state.engine.config.name:
        return _error(f"The model `{model}` does not exist.", 404, kind="NotFoundError",
                      param="model")
    return None


async def _generate(state: ServerState, request: Request, *, chat: bool) -> Response:
    arrival = time.monotonic()
    busy = _asleep_response(state)
    if busy is not None:
        return busy
    try:
        body = await _read_json(request)
        if not state.settings.lenient_fields:
            _check_fields(body, chat=chat)
        wrong = _check_model(state, body)
        if wrong is not None:
            return wrong
        tok = state.engine.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) for m in messages):
                msg = "'messages' must be a non-empty list of objects"
                raise _ParamError(msg, "messages")
            cont = bool(_get(body, "continue_final_message", (bool,), False))
            add = bool(_get(body, "add_generation_prompt", (bool,), not cont))
            if cont and add:
                msg = "continue_final_message and add_generation_prompt cannot both be true"
                raise _ParamError(msg, "continue_final_message")
            contents = [_content(m) for m in messages]
            for index, text in enumerate(contents):
                _check_encodable(tok, text, f"messages[{index}].content")
            prompt_ids = tok.apply_chat_template(
                [{"role": str(m.get("role", "user")), "content": text}
                 for m, text in zip(messages, contents, strict=True)],
                add_generation_prompt=add, continue_final_message=cont,
            )
            logprobs = (int(_get(body, "top_logprobs", (int,), 0))
                        if _get(body, "logprobs", (bool,), False) else None)
            default_max = None
        else:
            prompt_ids = _prompt_ids(state, body.get("prompt"))
            if _get(body, "echo", (bool,), False):
                msg = "echo is not supported"
                raise _ParamError(msg, "echo")
            logprobs = _get(body, "logprobs", (int,), None)
            default_max = 16  # OpenAI's default for /v1/completions
        if logprobs is not None and not 0 <= logprobs <= 20:
            msg = "logprobs must be between 0 and 20"
            raise _ParamError(msg, "logprobs")
        cfg = state.engine.config
        params = _sampling(body, len(prompt_ids), cfg.max_model_len, default_max, logprobs or 0)
        options = _options(body, logprobs, tok)
        rid = _request_id(request, "chatcmpl" if chat else "cmpl")
        if rid in state.engine.requests:
            return _error(f"request id {rid!r} is already running", 409,
                          param=REQUEST_ID_HEADER)
        engine_request = state.engine.new_request(prompt_ids, params, rid)
    except _ParamError as exc:
        return _error(str(exc), param=exc.param)
    except InvalidInput as exc:
        return _error(str(exc), param="prompt" if not chat else "messages")
    await _warm_up(state)
    job = _Job(engine_request, options, chat, prompt_ids,
               lambda: state.engine.submit(engine_request), arrival)
    return await _respond(state, job)


async def _warm_up(state: ServerState) -> None:
    """Hold the first generation `warmup_s`; requests that arrive meanwhile wait with it."""
    if state.warm:
        return
    if state.settings.warmup_s <= 0:
        state.warm = True
        return
    if state.warming is None:
        _log.info("first request: warming up for %.1f s", state.settings.warmup_s)
        state.warming = asyncio.ensure_future(asyncio.sleep(state.settings.warmup_s))
    # Shielded: a client that gives up does not cut the warm-up short for the others.
    await asyncio.shield(state.warming)
    state.warm = True


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    msg = "message 'content' must be a string or a list of text parts"
    raise _ParamError(msg, "messages")


def _check_encodable(tok: SimTokenizer, text: str, param: str) -> None:
    """A 400 naming `param` for text the tokenizer cannot encode (never a 500)."""
    try:
        tok.check_encodable(text)
    except InvalidInput as exc:
        raise _ParamError(f"'{param}': {exc}", param) from None


def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    tok = state.engine.tokenizer
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_encodable(tok, prompt, "prompt")
        return tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    msg = "'prompt' must be a string or a non-empty list of token ids (one prompt)"
    raise _ParamError(msg, "prompt")


def _check_admin(state: ServerState, request: Request) -> Response | None:
    denied = check_bearer(request.headers.get("authorization"), state.settings.admin_token,
                          unset="admin API disabled: no admin token configured on this engine")
    if denied is None:
        return None
    return _error(denied.message, denied.status,
                  kind="forbidden" if denied.status == 403 else "unauthorized",
                  headers=denied.headers)


def _crash(spec: FaultSpec, pci_bus_id: str) -> None:
    for line in xid_crash_lines(spec.xid, pci_bus_id):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(spec.exit_code)


def apply_fault(state: ServerState, spec: FaultSpec) -> None:
    """Act on a fault: schedule crash/hang on the event loop, record the others."""
    loop = asyncio.get_running_loop()
    # A short delay lets the admin call's own response leave first.
    delay = spec.after_s + 0.05
    if spec.kind == "crash":
        loop.call_later(delay, _crash, spec, state.settings.pci_bus_id)
    elif spec.kind == "hang":
        loop.call_later(delay, state.faults.hang, spec.duration_s)
    else:
        state.faults.apply(spec)
        state.engine.corrupt_logits = state.faults.sdc


def create_app(state: ServerState) -> Starlette:
    """The starlette app over a started or starting `ServerState`."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def models(_: Request) -> Response:
        cfg = state.engine.config
        return _json({"object": "list", "data": [{
            "id": cfg.name, "object": "model", "created": state.created, "owned_by": "ftctl",
            "root": cfg.name, "parent": None, "max_model_len": cfg.max_model_len,
        }]})

    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    async def health(_: Request) -> Response:
        if not state.driver.ready:
            return _json({"status": "starting"}, 503)
        if state.engine.asleep:
            return _json({"status": "asleep"}, 503)
        return _json({"status": "ok"})

    async def metrics(_: Request) -> Response:
        engine = state.engine
        state.metrics.running.set(engine.num_running)
        state.metrics.waiting.set(engine.num_waiting)
        state.metrics.kv_usage.set(engine.kv_usage)
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def sleep(request: Request) -> Response:
        # Sleep aborts every request in flight: an admin call, as vLLM's dev-mode routes
        # should be (issue 22: anyone could cut every stream with one POST).
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            level = 0
        if level not in (1, 2):
            return _error("level must be 1 or 2", param="level")
        aborted = await state.driver.run_locked(lambda: state.engine.sleep(level))
        state.driver.fail(aborted, "engine is going to sleep")
        return _json({"is_sleeping": True, "level": level, "aborted": len(aborted)})

    async def wake_up(request: Request) -> Response:
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        await state.driver.run_locked(state.engine.wake)
        return _json({"is_sleeping": False})

    async def is_sleeping(_: Request) -> Response:
        return _json({"is_sleeping": bool(state.engine.asleep)})

    async def fault(request: Request) -> Response:
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        if request.method == "GET":
            return _json(state.faults.to_json())
        try:
            spec = parse_fault(await _read_json(request))
        except InvalidInput as exc:
            return _error(str(exc))
        apply_fault(state, spec)
        return _json({"ok": True, "kind": spec.kind, "active": state.faults.to_json()})

    async def kv_export(request: Request) -> Response:
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        rid = request.path_params["request_id"]
        try:
            data = await state.driver.run_locked(lambda: state.engine.export_kv(rid))
        except InvalidInput as exc:
            return _error(str(exc), 404, kind="NotFoundError")
        if request.query_params.get("abort", "").lower() in ("1", "true", "yes"):
            state.engine.abort(rid, retain=True)
            state.driver.wake_loop()
        return Response(data, media_type="application/octet-stream", headers=_headers(rid))

    async def kv_import(request: Request) -> Response:
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        busy = _asleep_response(state)
        if busy is not None:
            return busy
        arrival = time.monotonic()
        payload = await request.body()
        # Before the import reserves blocks: a client gone during warm-up leaves none behind.
        await _warm_up(state)
        given = request.headers.get(REQUEST_ID_HEADER, "").strip() or None
        try:
            resumed = await state.driver.run_locked(
                lambda: state.engine.import_kv(payload, given))
        except InvalidInput as exc:
            return _error(str(exc))
        stream = request.query_params.get("stream", "true").lower() not in ("0", "false", "no")
        num_top = resumed.params.num_top
        options = _Options(stream=stream, include_usage=True, return_token_ids=True, stop=(),
                           logprobs=num_top if num_top else None)
        job = _Job(resumed, options, False, resumed.token_ids[: len(resumed.prompt_ids)],
                   lambda: state.engine.submit(resumed), arrival)
        return await _respond(state, job)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await state.driver.start()
        for spec in state.settings.faults:
            apply_fault(state, spec)
        try:
            yield
        finally:
            await state.driver.stop()

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/admin/fault", fault, methods=["GET", "POST"]),
        Route("/admin/kv/import", kv_import, methods=["POST"]),
        Route("/admin/kv/{request_id:path}", kv_export, methods=["GET"]),
    ]
    from starlette.middleware import Middleware

    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(_StallWhileHung, faults=state.faults)])


class _StallWhileHung:
    """The hang fault: every route but /admin/fault waits (the event loop stays free)."""

    def __init__(self, app: Any, faults: FaultState) -> None:
        self.app = app
        self.faults = faults

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (not self.faults.serving.is_set() and scope["type"] == "http"
                and scope["path"] != "/admin/fault"):
            await self.faults.serving.wait()
        await self.app(scope, receive, send)


def build_state(settings: ServerSettings) -> ServerState:
    """Build the model, cache and driver for `settings` (loads torch)."""
    import torch

    from dynamo_ftctl.engine.driver import AsyncEngine
    from dynamo_ftctl.engine.metrics import EngineMetrics
    from dynamo_ftctl.engine.scheduler import Engine

    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        msg = f"--device {settings.device}: CUDA is not available on this machine"
        raise InvalidInput(msg)
    engine = Engine(settings.config, settings.seed, settings.device)
    faults = FaultState(settings.pci_bus_id)
    metrics = EngineMetrics(settings.config.name, block_size=settings.config.block_size,
                            num_blocks=settings.config.num_blocks)
    return ServerState(settings, engine, AsyncEngine(engine, faults, metrics), faults, metrics)


class _QuietDrops(logging.Filter):
    """Keep uvicorn from logging a traceback for every stream the disconnect fault drops."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, DroppedByFault):
                return False
            nested = getattr(exc, "exceptions", None)
            if nested and any(isinstance(e, DroppedByFault) for e in nested):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: the kernel picks a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit TCP_NODELAY on Linux. Without it, a stream's headers and
    # first chunk (two small writes) meet Nagle + the client's delayed ACK: +40 ms TTFT.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        msg = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        raise InvalidInput(msg) from None
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def serve(settings: ServerSettings, *, on_ready: Callable[[str], None] | None = None) -> int:
    """Run the server in this thread until SIGINT/SIGTERM; `on_ready(url)` once serving."""
    import uvicorn

    from dynamo_ftctl.output import check_output_path, write_atomic

    if settings.pid_file is not None:
        check_output_path(settings.pid_file)  # before the model loads, not after
    state = build_state(settings)
    app = create_app(state)
    sock = bind_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    logging.getLogger("uvicorn.error").addFilter(_QuietDrops())
    install_log_redaction()
    # uvloop and httptools when installed (base dependencies): per streamed token, h11's
    # pure-Python framing and the default loop's transport cost more than the SSE
    # encoding itself (benchmarks/sim.py).
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            loop="auto", http="auto", ws="none", timeout_graceful_shutdown=3,
                            timeout_keep_alive=30)

    wrote_pid = False

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            nonlocal wrote_pid
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                if settings.pid_file is not None:
                    write_atomic(settings.pid_file, f"{os.getpid()}\n")
                    wrote_pid = True
                if on_ready is not None:
                    on_ready(url)

    server = _Server(config)
    try:
        server.run(sockets=[sock])
    except FtctlError:
        raise
    finally:
        sock.close()
        if settings.pid_file is not None and wrote_pid:  # never what it refused to replace
            settings.pid_file.unlink(missing_ok=True)
    return 0 if server.started else 1
