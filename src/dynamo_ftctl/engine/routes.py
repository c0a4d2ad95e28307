"""The `ftctl sim` routes: OpenAI API, health, metrics, sleep/wake, KV and faults.

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

Request fields are checked as vLLM checks them (`validation`); the first
generation after start waits `warmup_s` more (real engines compile and allocate
on their first batch; /health answers meanwhile). While the `hang` fault holds,
every route but /admin/fault waits (the event loop stays free).

Request ids: an `X-Request-Id` header names the request (the proxy and
`ftctl migrate` address requests by it); the response carries it in the same
header and as its `id`. JSON is written with ASCII escapes, so ids that are
not UTF-8 travel as `\\udcXX` and come back exactly (see `tokenizer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from dynamo_ftctl.auth import check_bearer
from dynamo_ftctl.engine.errors import ParamError, StreamFailed
from dynamo_ftctl.engine.faults import parse_fault
from dynamo_ftctl.engine.state import ServerState, apply_fault
from dynamo_ftctl.engine.stream import Job, sse, whole_answer
from dynamo_ftctl.engine.validation import (
    Options,
    check_fields,
    check_model,
    parse_body,
    parse_generation,
)
from dynamo_ftctl.errors import InvalidInput
from dynamo_ftctl.httpapp import Router, request_params
from dynamo_ftctl.httpserver import Handler, Reply, Request, Stream
from dynamo_ftctl.openai import error_body

if TYPE_CHECKING:
    from dynamo_ftctl.engine.scheduler import EngineRequest

__all__ = ["REQUEST_ID_HEADER", "create_router"]

_log = logging.getLogger("ftctl.sim")
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = REQUEST_ID_HEADER.lower().encode()
_YES = ("1", "true", "yes")


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    # allow_nan is left on (json's default): a logprob is clamped, never NaN.
    return Reply(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json",
                 dict(headers or {}))


def _error(message: str, status: int = 400, *, kind: str = "invalid_request_error",
           param: str | None = None, headers: Mapping[str, str] | None = None) -> Reply:
    return _json(error_body(message, type=kind, param=param, code=status), status, headers)


def _header(request: Request, name: bytes) -> str | None:
    """A request header as text (latin-1, as starlette decoded them), or None."""
    value = request.header(name)
    return None if value is None else value.decode("latin-1")


def _query(request: Request, name: str, default: str) -> str:
    values = parse_qs(request.query, keep_blank_values=True).get(name)
    return values[0] if values else default


def _request_id(request: Request, prefix: str) -> str:
    given = (_header(request, _REQUEST_ID) or "").strip()
    return given or f"{prefix}-{uuid.uuid4().hex}"


def _check_admin(state: ServerState, request: Request) -> Reply | None:
    denied = check_bearer(_header(request, b"authorization"), state.settings.admin_token,
                          unset="admin API disabled: no admin token configured on this engine")
    if denied is None:
        return None
    return _error(denied.message, denied.status,
                  kind="forbidden" if denied.status == 403 else "unauthorized",
                  headers=denied.headers)


def _asleep_response(state: ServerState) -> Reply | None:
    if state.engine.asleep or not state.driver.ready:
        what = "asleep" if state.engine.asleep else "starting"
        return _error(f"engine is {what}", 503, kind="service_unavailable")
    return None


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


async def _respond(state: ServerState, job: Job) -> Reply | Stream:
    rid = {REQUEST_ID_HEADER: job.request.request_id}
    if job.options.stream:
        return Stream(sse(state, job), headers={**rid, "Cache-Control": "no-cache"})
    try:
        body = await whole_answer(state, job)
    except StreamFailed as exc:
        kind = "service_unavailable" if exc.status == 503 else "InternalServerError"
        return _error(str(exc), exc.status, kind=kind, headers=rid)
    return _json(body, headers=rid)


def _job(state: ServerState, request: EngineRequest, options: Options, *, chat: bool,
         prompt_ids: list[int], arrival: float) -> Job:
    return Job(request, options, chat, prompt_ids, lambda: state.engine.submit(request),
               arrival)


async def _generate(state: ServerState, request: Request, *, chat: bool) -> Reply | Stream:
    arrival = time.monotonic()
    busy = _asleep_response(state)
    if busy is not None:
        return busy
    try:
        body = parse_body(request.body)
        if not state.settings.lenient_fields:
            check_fields(body, chat=chat)
        wrong = check_model(body, state.engine.config.name)
        if wrong is not None:
            return _error(f"The model `{wrong}` does not exist.", 404, kind="NotFoundError",
                          param="model")
        generation = parse_generation(body, state.engine.config, state.engine.tokenizer,
                                      chat=chat)
        rid = _request_id(request, "chatcmpl" if chat else "cmpl")
        if rid in state.engine.requests:
            return _error(f"request id {rid!r} is already running", 409,
                          param=REQUEST_ID_HEADER)
        engine_request = state.engine.new_request(generation.prompt_ids, generation.params,
                                                  rid)
    except ParamError as exc:
        return _error(str(exc), param=exc.param)
    except InvalidInput as exc:
        return _error(str(exc), param="prompt" if not chat else "messages")
    await _warm_up(state)
    options = generation.options
    if state.settings.dynamo:  # Dynamo's OpenAI answers carry no generated ids
        options = dataclasses.replace(options, return_token_ids=False)
    job = _job(state, engine_request, options, chat=chat,
               prompt_ids=generation.prompt_ids, arrival=arrival)
    return await _respond(state, job)


class _Routes:
    """The handlers over one `ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def models(self, _: Request) -> Reply:
        state = self.state
        cfg = state.engine.config
        return _json({"object": "list", "data": [{
            "id": cfg.name, "object": "model", "created": state.created, "owned_by": "ftctl",
            "root": cfg.name, "parent": None, "max_model_len": cfg.max_model_len,
        }]})

    async def completions(self, request: Request) -> Reply | Stream:
        return await _generate(self.state, request, chat=False)

    async def chat(self, request: Request) -> Reply | Stream:
        return await _generate(self.state, request, chat=True)

    async def health(self, _: Request) -> Reply:
        if not self.state.driver.ready:
            return _json({"status": "starting"}, 503)
        if self.state.engine.asleep:
            return _json({"status": "asleep"}, 503)
        return _json({"status": "ok"})

    async def metrics(self, _: Request) -> Reply:
        engine, metrics = self.state.engine, self.state.metrics
        metrics.running.set(engine.num_running)
        metrics.waiting.set(engine.num_waiting)
        metrics.kv_usage.set(engine.kv_usage)
        return Reply(200, metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def sleep(self, request: Request) -> Reply:
        # Sleep aborts every request in flight: an admin call, as vLLM's dev-mode routes
        # should be (open, anyone could cut every stream with one POST).
        state = self.state
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        try:
            level = int(_query(request, "level", "1"))
        except ValueError:
            level = 0
        if level not in (1, 2):
            return _error("level must be 1 or 2", param="level")
        aborted = await state.driver.run_locked(lambda: state.engine.sleep(level))
        state.driver.fail(aborted, "engine is going to sleep")
        return _json({"is_sleeping": True, "level": level, "aborted": len(aborted)})

    async def wake_up(self, request: Request) -> Reply:
        denied = _check_admin(self.state, request)
        if denied is not None:
            return denied
        await self.state.driver.run_locked(self.state.engine.wake)
        return _json({"is_sleeping": False})

    async def is_sleeping(self, _: Request) -> Reply:
        return _json({"is_sleeping": bool(self.state.engine.asleep)})

    async def fault(self, request: Request) -> Reply:
        state = self.state
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        if request.method in ("GET", "HEAD"):
            return _json(state.faults.to_json())
        try:
            spec = parse_fault(parse_body(request.body))
        except InvalidInput as exc:
            return _error(str(exc))
        apply_fault(state, spec)
        return _json({"ok": True, "kind": spec.kind, "active": state.faults.to_json()})

    async def kv_export(self, request: Request) -> Reply:
        state = self.state
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        # Percent-decoded, as starlette decoded the path before matching it.
        rid = unquote(request_params(request)["request_id"])
        try:
            data = await state.driver.run_locked(lambda: state.engine.export_kv(rid))
        except InvalidInput as exc:
            return _error(str(exc), 404, kind="NotFoundError")
        if _query(request, "abort", "").lower() in _YES:
            state.engine.abort(rid, retain=True)
            state.driver.wake_loop()
        return Reply(200, bytes(data), "application/octet-stream", {REQUEST_ID_HEADER: rid})

    async def kv_import(self, request: Request) -> Reply | Stream:
        state = self.state
        denied = _check_admin(state, request)
        if denied is not None:
            return denied
        busy = _asleep_response(state)
        if busy is not None:
            return busy
        arrival = time.monotonic()
        # Before the import reserves blocks: a client gone during warm-up leaves none behind.
        await _warm_up(state)
        given = (_header(request, _REQUEST_ID) or "").strip() or None
        try:
            resumed = await state.driver.run_locked(
                lambda: state.engine.import_kv(request.body, given))
        except InvalidInput as exc:
            return _error(str(exc))
        stream = _query(request, "stream", "true").lower() not in ("0", "false", "no")
        num_top = resumed.params.num_top
        options = Options(stream=stream, include_usage=True, return_token_ids=True, stop=(),
                          logprobs=num_top if num_top else None)
        job = _job(state, resumed, options, chat=False,
                   prompt_ids=resumed.token_ids[: len(resumed.prompt_ids)], arrival=arrival)
        return await _respond(state, job)


def create_router(state: ServerState) -> Handler:
    """The sim's handler over a started or starting `ServerState` (for `httpserver`)."""
    routes = _Routes(state)
    router = Router()
    router.get("/v1/models", routes.models)
    router.post("/v1/completions", routes.completions)
    router.post("/v1/chat/completions", routes.chat)
    router.get("/health", routes.health)
    router.get("/metrics", routes.metrics)
    router.post("/sleep", routes.sleep)
    router.post("/wake_up", routes.wake_up)
    router.get("/is_sleeping", routes.is_sleeping)
    router.get("/admin/fault", routes.fault)
    router.post("/admin/fault", routes.fault)
    router.post("/admin/kv/import", routes.kv_import)
    router.get("/admin/kv/{request_id:path}", routes.kv_export)
    serving = state.faults.serving

    async def handle(request: Request) -> Reply | Stream:
        # The hang fault: every route but /admin/fault waits (the event loop stays free).
        if not serving.is_set() and request.path != "/admin/fault":
            await serving.wait()
        return await router(request)

    return handle
