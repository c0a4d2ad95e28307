"""The sim's answers to a generation: token steps, SSE chunks and whole bodies.

`step_batches` follows one engine request: detokenized, stop strings applied, the
`disconnect` fault enforced (it raises `DroppedByFault`, which the server turns
into a dropped connection). `sse` frames a stream's body, `whole_answer` builds a
non-streamed one. Nothing here knows HTTP: the routes wrap these in the server's
`Stream` and `Reply`, and a client that leaves cancels the task that pulls `sse`
(its `finally` aborts the engine request).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _enc  # what json.dumps uses for str
from typing import TYPE_CHECKING, Any

from dynamo_ftctl.engine.errors import DroppedByFault, StreamFailed
from dynamo_ftctl.engine.tokenizer import IncrementalDetokenizer
from dynamo_ftctl.openai import DONE, StopFinder, error_body, format_sse

if TYPE_CHECKING:
    from dynamo_ftctl.engine.scheduler import EngineRequest
    from dynamo_ftctl.engine.state import ServerState
    from dynamo_ftctl.engine.validation import Options

__all__ = ["SERVER_TTFT_FIELD", "ChunkWriter", "Job", "Step", "sse", "step_batches",
           "whole_answer"]

# vLLM clamps -inf logprobs to this so that JSON stays valid.
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


@dataclass
class Step:
    """One token's rendering: its text delta and logprob entry."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...]
    finish_reason: str | None


async def step_batches(state: ServerState, request: EngineRequest, options: Options,
                       start: Callable[[], object], arrival: float,
                       ) -> AsyncIterator[list[Step]]:
    """Token steps of a request, detokenized, stop strings applied, faults enforced.

    Each batch holds the tokens that were waiting when the stream woke up (one in
    the steady state), so a stream that fell behind catches up in one write.
    """
    detok = IncrementalDetokenizer(state.engine.tokenizer, request.prompt_ids)
    stopper = StopFinder(options.stop)
    sent = 0
    first = True
    async for events in state.driver.follow_batches(request, start):
        steps: list[Step] = []
        for event in events:
            if event.error is not None:
                if steps:
                    yield steps
                # Asleep: the server is unavailable now (503, come back later); anything
                # else (a failed step, a contained Xid) is an internal error (500), as on
                # vLLM, which a proxy must not take for backpressure.
                raise StreamFailed(event.error, 503 if state.engine.asleep else 500)
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
            steps.append(Step(token.token_id, text, token.logprob, token.top, finish))
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


_ERROR_TYPES = {500: "InternalServerError", 503: "service_unavailable"}


def _completion_logprobs(state: ServerState, steps: Sequence[Step], offset: int) -> dict[str, Any]:
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


def _chat_logprobs(state: ServerState, steps: Sequence[Step]) -> dict[str, Any]:
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
class Job:
    """A validated generation request and how to answer it."""

    request: EngineRequest
    options: Options
    chat: bool
    prompt_ids: list[int]
    start: Callable[[], object]
    arrival: float


async def whole_answer(state: ServerState, job: Job) -> dict[str, Any]:
    """The body of a non-streamed answer, once the request has finished (`StreamFailed`
    when the engine ended it with an error)."""
    steps: list[Step] = []
    async for batch in step_batches(state, job.request, job.options, job.start, job.arrival):
        steps.extend(batch)
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
    return body


SERVER_TTFT_FIELD = "ftctl_server_ttft_ms"
"""Top-level field of a stream's finishing chunk: this server's own TTFT for the request
(arrival of the request -> its first token chunk handed to the socket), in ms."""


class ChunkWriter:
    """SSE chunks of one stream, byte for byte what `format_sse(dict)` writes.

    Token chunks without logprobs (nearly all of them) are filled into a prefix
    built once per stream, with the C string encoder `json.dumps` itself uses:
    no dict and no JSON encoder per token.
    """

    __slots__ = ("chat", "created", "kind", "model", "nvext", "prefix", "rid", "token_ids")

    def __init__(self, rid: str, model: str, created: int, *, chat: bool,
                 token_ids: bool, nvext: dict[str, Any] | None = None) -> None:
        self.rid, self.model, self.created, self.chat = rid, model, created, chat
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.token_ids = token_ids
        self.nvext = nvext  # Dynamo's response extension, in every chunk (`--dynamo`)
        self.prefix = (f'data: {{"id":{_enc(rid)},"object":"{self.kind}","created":{created},'
                       f'"model":{_enc(model)},"choices":[{{"index":0,"finish_reason":')

    def chunk(self, choice: dict[str, Any], **top: Any) -> bytes:
        """Any chunk, through the JSON encoder."""
        if self.nvext is not None:
            top = {**top, "nvext": self.nvext}
        return format_sse({"id": self.rid, "object": self.kind, "created": self.created,
                           "model": self.model, "choices": [choice], **top})

    def token(self, step: Step, ttft_ms: float | None) -> str:
        """A plain token chunk (no logprobs, no prompt ids) as text."""
        finish = "null" if step.finish_reason is None else _enc(step.finish_reason)
        body = (f'{{"content":{_enc(step.text)}}}' if self.chat else _enc(step.text))
        ids = f',"token_ids":[{step.token_id}]' if self.token_ids else ""
        tail = "" if ttft_ms is None else f',"{SERVER_TTFT_FIELD}":{ttft_ms!r}'
        if self.nvext is not None:
            tail += f',"nvext":{json.dumps(self.nvext, separators=(",", ":"))}'
        field_name = '"delta"' if self.chat else '"text"'
        return f"{self.prefix}{finish},{field_name}:{body}{ids}}}]{tail}}}\n\n"


async def sse(state: ServerState, job: Job) -> AsyncGenerator[bytes, None]:
    """The body of a stream: one write per batch of steps, the end in the last write."""
    options = job.options
    dynamo = state.settings.dynamo
    writer = ChunkWriter(job.request.request_id, state.engine.config.name, int(time.time()),
                         chat=job.chat, token_ids=options.return_token_ids,
                         nvext={"worker_id": {"decode_worker_id": state.settings.seed}}
                         if dynamo else None)
    count = 0
    offset = 0
    ttft_ms: float | None = None
    arrival = job.arrival
    fast = options.logprobs is None

    if dynamo:  # Dynamo's annotation: an event with its value in a comment, no data
        ids = json.dumps(job.prompt_ids, separators=(",", ":"))
        yield f"event: token_ids\n: {ids}\n\n".encode()
    if job.chat:
        first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}
        extra = {"prompt_token_ids": job.prompt_ids} if options.return_token_ids else {}
        yield writer.chunk(first, **extra)
    try:
        async for batch in step_batches(state, job.request, options, job.start, arrival):
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
    except StreamFailed as exc:
        yield format_sse(error_body(str(exc), type=_ERROR_TYPES[exc.status], code=exc.status))
        return
    # Ended without a finish reason (the request was aborted without an error).
    if options.include_usage:
        yield format_sse({"id": writer.rid, "object": writer.kind, "created": writer.created,
                          "model": writer.model, "choices": [],
                          "usage": _usage(len(job.prompt_ids), count)})
    yield format_sse(DONE)


def _slow_chunk(state: ServerState, writer: ChunkWriter, job: Job, step: Step, *,
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
